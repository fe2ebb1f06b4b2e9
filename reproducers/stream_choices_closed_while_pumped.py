"""Found by review (session 22): when a client left a stream of several choices (n > 1), the merge of their event
streams cancelled each choice's pump task and closed its stream at once, while the pump was still inside it:
"aclose(): asynchronous generator is already running", logged as an "Exception in ASGI application" on every such
disconnect (the requests were aborted all the same). Fixed when the merge waits for the cancelled pumps first."""

import logging
import time

import _common
import httpx  # noqa: E402

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.serving import requests_left_after, serve_in_thread  # noqa: E402

errors: list[str] = []


class Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            errors.append(record.getMessage() + (f" {record.exc_info[1]!r}" if record.exc_info else ""))


logging.getLogger().addHandler(Collect())
served = serve_in_thread(ServerSettings(), log_config=None)  # tiny checkpoint; logs reach the root
body = {"model": served.app.state.prism.settings.served_model_name, "messages": [{"role": "user", "content": "Talk."}],
        "max_tokens": 2000, "n": 2, "ignore_eos": True, "stream": True}
with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=60) as response:
    for i, _ in enumerate(response.iter_lines()):
        if i == 10:
            break  # the client leaves
left = requests_left_after(served.engine, 5)
time.sleep(0.3)  # what the closing logs
served.server.should_exit = True
_common.verdict(not errors and not left, "two choices left midway: aborted, nothing logged as an error",
                f"errors logged: {errors[:2]}; still running: {left}")
