"""Found by review (session 22): a non-streaming chat completion or decide whose client disconnected kept its
engine requests running to the end (uvicorn does not cancel a handler when its client leaves, and only the SSE
path watched): up to max_model_len tokens for nobody, holding pages and seats, and holding up a graceful shutdown.
Fixed when both endpoints watch for the disconnect while they wait (`cancellation.until_disconnected`) and abort."""

import _common
import httpx  # noqa: E402

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.serving import requests_left_after, serve_in_thread  # noqa: E402

served = serve_in_thread(ServerSettings())  # the embedded tiny checkpoint
body = {"model": served.app.state.prism.settings.served_model_name, "messages": [{"role": "user", "content": "Talk."}],
        "max_tokens": 4000, "ignore_eos": True}
try:
    httpx.post(served.url + "/v1/chat/completions", json=body, timeout=1.0)
except httpx.TimeoutException:
    pass  # the client gives up
left = requests_left_after(served.engine, 5)
served.server.should_exit = True
_common.verdict(not left, "the client left and its request was aborted",
                f"5 s after its client left, {left} still ran")
