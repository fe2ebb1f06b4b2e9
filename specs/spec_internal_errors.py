"""Spec of the server's 500s (`serving/internal_errors.py`, `serving/choices.py` `sse` / `json_or_error`,
`serving/refusals.py` `error_response`), over real HTTP: uvicorn in a thread, the tiny checkpoint.

Invariant: whatever fails while a request is served (the engine losing its step, the engine thread's step raising, a
handler raising before it submits, the answer failing to render), whichever endpoint and whether it streams, the
client gets exactly the internal error body naming a request id (a JSON 500 with that id in X-Request-Id too; a
stream: that body as its last event before [DONE]) and nothing of the failure's text; the log names the id with the
failure's text; nothing is left running; the same when one of a completion's choices fails while its events are
read. (The operator's review: the engine's reasons went out as they were, e.g.
"RuntimeError: <the exception's text>", a stream failing to render was cut without an end, a ValueError while a
response was built was Starlette's plain-text 500.) A ValueError before submission is a refusal by design (a 400
with its message), so the failures drawn there are of other types.
"""

from __future__ import annotations

import functools
import json
import logging
import re

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.serving import app as app_module
from prism.serving.completions import CompletionRenderer
from prism.serving.internal_errors import internal_error_body
from prism.serving.metrics import RequestTracker
from prism.serving.settings import ServerSettings
from prism.serving.stream import ChatCompletionStream
from prism.testing.serving import failing_at, requests_left_after, serve_in_thread

MODEL = "prism-tiny"
MARK = "SECRET:"
REQUEST_ID = re.compile(r"req-[0-9a-f]{32}")
ENDPOINTS = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 4, "ignore_eos": True}),
    "completion": ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True}),
    "decide": ("/v1/decide", {"model": MODEL, "material": [{"role": "user", "content": "Hi"}],
                              "questions": [{"type": "yes_no", "text": "Is it?"}]}),
}
# What renders each answer: (owner, attribute) by (endpoint, streamed).
RENDERERS = {
    ("chat", False): (app_module, "build_response"), ("chat", True): (ChatCompletionStream, "on_output"),
    ("completion", False): (CompletionRenderer, "response"), ("completion", True): (CompletionRenderer, "on_output"),
    ("decide", False): (app_module, "decide_response"),
}
ERRORS = (RuntimeError, ValueError, KeyError, TypeError, AssertionError, OSError)


@functools.lru_cache(maxsize=1)
def served():
    return serve_in_thread(ServerSettings())  # a daemon thread: it ends with the process


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        trace = logging.Formatter().formatException(record.exc_info) if record.exc_info else ""
        self.texts.append(f"{record.getMessage()}\n{trace}")


@st.composite
def failures(draw):
    endpoint = draw(st.sampled_from(sorted(ENDPOINTS)))
    stream = endpoint != "decide" and draw(st.booleans())
    where = draw(st.sampled_from(["lost step", "engine thread", "before submission", "rendering"]))
    kinds = [k for k in ERRORS if not (where == "before submission" and issubclass(k, ValueError))]
    error = draw(st.sampled_from(kinds))(MARK + draw(st.text(max_size=20)))
    at_call = draw(st.integers(1, 3)) if (where, stream) == ("rendering", True) else 1
    return endpoint, stream, where, error, at_call


def _planted(server, endpoint: str, stream: bool, where: str):
    engine = server.engine
    if where == "lost step":
        return engine.runner, "execute"
    if where == "engine thread":
        return engine, "step"
    if where == "before submission":
        return engine.inputs, "prepare_prompt" if endpoint == "completion" else "prepare_chat"
    return RENDERERS[endpoint, stream]


def _ask(server, path: str, body: dict, stream: bool, planted: tuple, error: BaseException, at_call: int, case: str
         ) -> tuple[httpx.Response, list[str]]:
    """The response to `body` with `planted` (owner, attribute) failing at its `at_call`-th call, and what was logged
    at ERROR meanwhile."""
    requests_left_after(server.engine, 5)  # the engine idle, so that the planted call is this request's
    records = _Records()
    logging.getLogger("prism").addHandler(records)
    try:
        with failing_at(*planted, error, at_call):
            return httpx.post(server.url + path, json={**body, "stream": True} if stream else body,
                              timeout=10), records.texts
    except httpx.RemoteProtocolError as cut:
        raise AssertionError(f"{case}: the response was cut: {cut}") from None
    except httpx.ReadTimeout:
        raise AssertionError(f"{case}: no answer 10 s after the request") from None
    finally:
        logging.getLogger("prism").removeHandler(records)


def _check_internal_error(server, response: httpx.Response, logged: list[str], streamed: bool,
                          error: BaseException, case: str) -> None:
    """The answer is exactly the internal error body (`streamed`: a stream's last event before [DONE]), with nothing
    of the failure; the log names its id with the failure; nothing is left running."""
    assert "SECRET" not in response.text, f"{case}: the failure's text went out: {response.text}"
    if streamed:
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
        assert response.status_code == 200 and events and events[-1] == "[DONE]", f"{case}: {response.text}"
        answer = json.loads(events[-2])
    else:
        assert response.status_code == 500, f"{case}: {response.status_code} {response.text}"
        answer = response.json()
    ids = REQUEST_ID.findall(json.dumps(answer))
    assert len(ids) == 1 and answer == internal_error_body(ids[0]), f"{case}: not the internal error body: {answer}"
    assert streamed or response.headers.get("x-request-id") == ids[0], f"{case}: headers {dict(response.headers)}"
    logged = [text for text in logged if ids[0] in text]
    assert any(str(error) in text for text in logged), f"{case}: the log has no {ids[0]} with the failure: {logged}"
    left = requests_left_after(server.engine, 5)
    assert not left, f"{case}: still running: {left}"


@settings(max_examples=30, deadline=None)
@given(failure=failures())
def spec_a_500_names_only_a_request_id(failure) -> None:
    endpoint, stream, where, error, at_call = failure
    server, (path, body) = served(), ENDPOINTS[endpoint]
    case = f"{where} on {endpoint} (stream: {stream}, {error!r})"
    response, logged = _ask(server, path, body, stream, _planted(server, endpoint, stream, where), error, at_call, case)
    # a stream's 200 went out once its choices were submitted: then its end is the answer
    _check_internal_error(server, response, logged, stream and where != "before submission", error, case)


@st.composite
def failing_choices(draw):
    """(endpoint, stream, n, the event of the completion at which reading fails, the error): each choice has one
    event per token, so there are n * max_tokens events."""
    endpoint, n = draw(st.sampled_from(["chat", "completion"])), draw(st.integers(1, 3))
    at_call = draw(st.integers(1, n * ENDPOINTS[endpoint][1]["max_tokens"]))
    return endpoint, draw(st.booleans()), n, at_call, draw(st.sampled_from(ERRORS))(MARK + draw(st.text(max_size=20)))


@settings(max_examples=20, deadline=None)
@given(failing=failing_choices())
def spec_a_choice_failing_while_its_events_are_read_ends_its_completion(failing) -> None:
    """Of n choices, one's events fail to be read (the metrics' observer raises at the `at_call`-th event of the
    completion): the completion ends with the internal error (before: with n > 1 the choice's pump task died unseen
    and the merge waited for its events forever, streamed or not)."""
    endpoint, stream, n, at_call, error = failing
    server, (path, body) = served(), ENDPOINTS[endpoint]
    case = f"{endpoint} of {n} choice(s) (stream: {stream}), event {at_call} failing with {error!r}"
    response, logged = _ask(server, path, {**body, "n": n}, stream, (RequestTracker, "__call__"), error, at_call, case)
    _check_internal_error(server, response, logged, stream, error, case)
