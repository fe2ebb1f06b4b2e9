"""Found while checking an operator's review of the server's 500s: in a completion of several choices (n > 1), a
choice whose events failed to be read (here the metrics' observer raising) ended its pump task with the exception
unseen, and the completion waited for that choice's events forever: no answer, streamed or not, and nothing logged.
Fixed when the merge of the choices raises what a pump raised (`choices._merge`), so the completion ends with the
internal error (a 500, or a stream's error event and [DONE])."""

import _common
import httpx  # noqa: E402

from prism.serving.metrics import RequestTracker  # noqa: E402
from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

served = serve_in_thread(ServerSettings())  # the embedded tiny checkpoint
real, calls = RequestTracker.__call__, []


def failing_at_the_third_event(self, event, now):
    calls.append(None)
    if len(calls) == 3:
        raise RuntimeError("the observer failed")
    return real(self, event, now)


RequestTracker.__call__ = failing_at_the_third_event
body = {"model": served.app.state.prism.settings.served_model_name, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8, "ignore_eos": True, "n": 2}
answers = {}
for stream in (False, True):
    calls.clear()
    try:
        response = httpx.post(served.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=10)
        answers[stream] = (response.status_code, '"internal_error"' in response.text)
    except httpx.ReadTimeout:
        answers[stream] = None
RequestTracker.__call__ = real
served.stop()  # the engine thread stopped before the process exits
_common.verdict(answers == {False: (500, True), True: (200, True)},
                "the completion ended with the internal error, streamed (an error event) or not (a 500)",
                f"(status, an internal error) of the completion, by whether it streamed: {answers} (None: no answer "
                "within 10 s)")
