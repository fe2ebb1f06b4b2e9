"""Found by review (session 22): a non-streaming chat completion or decide whose client disconnected kept its
engine requests running to the end (uvicorn does not cancel a handler when its client leaves, and only the SSE
path watched): up to max_model_len tokens for nobody, holding pages and seats, and holding up a graceful shutdown.
Fixed when both endpoints watch for the disconnect while they wait (`app._until_disconnected`) and abort."""

import socket
import threading
import time

import _common  # noqa: F401
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from prism.serving.app import create_app  # noqa: E402
from prism.serving.settings import ServerSettings  # noqa: E402

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
port = sock.getsockname()[1]
sock.close()
app = create_app(ServerSettings())  # the embedded tiny checkpoint
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
threading.Thread(target=server.run, daemon=True).start()
while not server.started:
    time.sleep(0.05)
body = {"model": app.state.prism.settings.served_model_name, "messages": [{"role": "user", "content": "Talk."}],
        "max_tokens": 4000, "ignore_eos": True}
try:
    httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=1.0)
except httpx.TimeoutException:
    pass  # the client gives up
engine = app.state.prism.engine
deadline = time.time() + 5
while engine.requests and time.time() < deadline:
    time.sleep(0.05)
left = list(engine.requests)
server.should_exit = True
_common.verdict(not left, "the client left and its request was aborted",
                f"5 s after its client left, {left} still ran")
