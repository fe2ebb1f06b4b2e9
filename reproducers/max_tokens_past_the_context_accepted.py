"""Found by review (session 22): a chat completion whose explicit max_tokens the context cannot hold (2**70, or
32767 beside a prompt) was accepted and cut short at max_model_len with finish_reason "length", where vLLM and
OpenAI answer 400. Fixed when prompt + max_tokens (or max_completion_tokens) over max_model_len is a 400 naming
the field; routing errors (404, 405) also got FastAPI's {"detail": ...} instead of an OpenAI error body."""

import _common
import httpx  # noqa: E402

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

served = serve_in_thread(ServerSettings())  # the embedded tiny checkpoint
body = {"model": served.app.state.prism.settings.served_model_name, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2**40}
try:
    response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=20)
    status, said = response.status_code, response.text[:160]
except httpx.TimeoutException:
    status, said = None, "no answer in 20 s (generating toward max_model_len)"
routed = httpx.get(served.url + "/v1/chat/completions", timeout=20)
served.server.should_exit = True
ok = status == 400 and routed.status_code == 405 and "error" in routed.json()
_common.verdict(ok, f"max_tokens 2**40: {status} {said}; GET: {routed.status_code} {routed.text[:80]}",
                f"max_tokens 2**40: {status} {said}; GET: {routed.status_code} {routed.text[:80]}")
