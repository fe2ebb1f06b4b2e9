"""Found by review (session 22): when a client left a stream of several choices (n > 1), the merge of their event
streams cancelled each choice's pump task and closed its stream at once, while the pump was still inside it:
"aclose(): asynchronous generator is already running", logged as an "Exception in ASGI application" on every such
disconnect (the requests were aborted all the same). Fixed when the merge waits for the cancelled pumps first."""

import logging
import socket
import threading
import time

import _common  # noqa: F401
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from prism.serving.app import create_app  # noqa: E402
from prism.serving.settings import ServerSettings  # noqa: E402

errors: list[str] = []


class Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            errors.append(record.getMessage() + (f" {record.exc_info[1]!r}" if record.exc_info else ""))


logging.getLogger().addHandler(Collect())
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
port = sock.getsockname()[1]
sock.close()
app = create_app(ServerSettings())  # the embedded tiny checkpoint
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))  # its logs reach the root
threading.Thread(target=server.run, daemon=True).start()
while not server.started:
    time.sleep(0.05)
body = {"model": app.state.prism.settings.served_model_name, "messages": [{"role": "user", "content": "Talk."}],
        "max_tokens": 2000, "n": 2, "ignore_eos": True, "stream": True}
with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as response:
    for i, _ in enumerate(response.iter_lines()):
        if i == 10:
            break  # the client leaves
engine = app.state.prism.engine
deadline = time.time() + 5
while engine.requests and time.time() < deadline:
    time.sleep(0.05)
time.sleep(0.3)
server.should_exit = True
_common.verdict(not errors and not engine.requests, "two choices left midway: aborted, nothing logged as an error",
                f"errors logged: {errors[:2]}; still running: {list(engine.requests)}")
