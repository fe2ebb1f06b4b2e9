"""Found by an operator's review of the server: a 500 carried internal text. A choice the engine failed was answered
with the engine's reason ("RuntimeError: <the exception's text>", "engine failure: <...>") as the message, in the JSON
body and in a stream's error event; a failed decide with "question 0 failed: RuntimeError: <...>". Fixed when every
500 is the internal error body (a fixed message naming a request id; `serving/internal_errors.py`) and the failure is
logged under that id. Checked here: a step that raises with a path in its message, under a chat completion, a stream
and a decide."""

import json
import logging
import re

import _common
import httpx  # noqa: E402

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

SECRET = "CUDA error at /opt/models/qwen/internal.py:42"
logged: list[str] = []


class Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logged.append(record.getMessage())


logging.getLogger("prism.server").addHandler(Keep(logging.ERROR))
served = serve_in_thread(ServerSettings())  # the embedded tiny checkpoint
runner = served.engine.runner
real = runner.execute


def failing_once(*args, **kwargs):
    runner.execute = real
    raise RuntimeError(SECRET)


name = served.app.state.prism.settings.served_model_name
asks = {
    "chat completion": ("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "Hi"}]}),
    "stream": ("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "Hi"}],
                                        "stream": True}),
    "decide": ("/v1/decide", {"model": name, "material": [{"role": "user", "content": "Hi"}],
                              "questions": [{"type": "yes_no", "text": "Is it?"}]}),
}
problems = []
for what, (path, body) in asks.items():
    runner.execute = failing_once
    text = httpx.post(served.url + path, json=body, timeout=60).text
    message = json.loads(text.split("data: ")[-2] if body.get("stream") else text)["error"]["message"]
    ids = re.findall(r"req-[0-9a-f]{32}", message)
    if SECRET in text:
        problems.append(f"the {what}'s 500 says {message!r}")
    elif not ids or not any(ids[0] in line and SECRET in line for line in logged):
        problems.append(f"the {what}'s 500 ({message!r}) names no request id that the log names with the failure")
served.stop()  # the engine thread stopped before the process exits
_common.verdict(not problems, "each 500 names only a request id, under which the log has the failure",
                "; ".join(problems))
