"""What the clients of `spec_server_nothing_lost.py` do, and what each must get back: chat and text completions
(streamed or not, with an image or not, n of 1-2, stop strings, logprobs), images named by uuid, decides, a client
that leaves a stream after its first event, one that gives up before its answer, bodies the server refuses; `perform` does one as its
client would, asserts that the answer is well-formed, and returns the counters of `/metrics` it must move.
"""

from __future__ import annotations

import base64
import io
import json
import re
import threading
from collections import Counter
from dataclasses import dataclass, replace

import httpx
import numpy as np
from hypothesis import strategies as st
from PIL import Image

from prism.serving.internal_errors import internal_error_body

MODEL = "prism-tiny"
CHAT, COMPLETIONS, DECIDE = "/v1/chat/completions", "/v1/completions", "/v1/decide"
LONG = 16_000  # tokens of a request whose client leaves: minutes of work if it is not aborted
REQUEST_ID = re.compile(r"req-[0-9a-f]{32}")
Series = tuple[str, str]  # a counter of /metrics: (family without "prism:", label value)


def _png_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMAGES = [_png_url(seed) for seed in range(2)]


# -- what clients send ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ask:
    """One client's action: `body` (JSON, or raw bytes) POSTed to `path`, read as `how` says: "answer" (all of it),
    "disconnect" (its first event, then the connection closed), "leave" (giving up before the answer)."""

    what: str  # the action's name: coverage and messages
    path: str
    body: dict | bytes
    how: str = "answer"
    status: int = 200  # what a refusal must get
    choices: int = 1  # its completion's choices (an engine request each), or its decide's questions
    fails: bool = False  # a planted step failure hits it: a 500
    may_fail: bool = False  # it runs beside a planted step failure: a 500 as `fails` says, or its answer
    message: str = ""  # what a refusal's message must say (a regex)
    hits: bool = False  # its prompt must hit the prefix cache (where its usage is read)

    @property
    def streamed(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))


def _message(text: str, image: str | dict | None) -> list[dict]:
    """A user message of `text` after `image` (a URL, or a whole image part)."""
    if image is None:
        return [{"role": "user", "content": text}]
    part = image if isinstance(image, dict) else {"type": "image_url", "image_url": {"url": image}}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def named_image(uuid: str, image: int | None) -> dict:
    """An image part naming `IMAGES[image]` `uuid` as it sends it, or (`image` None) naming it by `uuid` alone."""
    return {"type": "image_url", "image_url": None if image is None else {"url": IMAGES[image]}, "uuid": uuid}


@st.composite
def chats(draw, how: str = "answer", stream: bool | None = None, image_part: dict | None = None) -> Ask:
    """`image_part`: the image the message holds (one drawn, or none, without it)."""
    image = image_part or draw(st.sampled_from([None, *IMAGES]))
    stream = draw(st.booleans()) if stream is None else stream
    n = draw(st.integers(1, 2))
    body = {"model": MODEL, "messages": _message(draw(st.sampled_from(["Hi", "What is it?"])), image), "n": n,
            "stream": stream, "max_tokens": LONG if how != "answer" else draw(st.integers(1, 6))}
    if how != "answer":
        body["ignore_eos"] = True
    elif draw(st.booleans()):
        body["stop"] = draw(st.lists(st.sampled_from(["e", " the", "a", "\n"]), min_size=1, max_size=2))
    if how == "answer" and draw(st.booleans()):
        body |= {"logprobs": True, "top_logprobs": draw(st.integers(0, 2))}
    if stream and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    what = "chat" + " streamed" * stream + " with an image" * (image is not None)
    return Ask(what, CHAT, body, how, choices=n)


@st.composite
def completions(draw, how: str = "answer", stream: bool | None = None) -> Ask:
    prompts = draw(st.sampled_from([["Once upon"], ["One", "Two"]]))
    stream = draw(st.booleans()) if stream is None else stream
    n = draw(st.integers(1, 2))
    body = {"model": MODEL, "prompt": prompts if len(prompts) > 1 else prompts[0], "n": n, "stream": stream,
            "max_tokens": LONG if how != "answer" else draw(st.integers(1, 6))}
    if how != "answer":
        body["ignore_eos"] = True
    else:
        body |= draw(st.sampled_from([{}, {"stop": ["e"]}, {"logprobs": 2}, {"echo": True}]))
    return Ask("completion" + " streamed" * stream, COMPLETIONS, body, how, choices=n * len(prompts))


QUESTIONS = [{"type": "yes_no", "text": "Is it dark?"}, {"type": "choice", "text": "Which?", "options": ["a", "b", "c"]},
             {"type": "score", "text": "How much?", "levels": [1, 2, 3]}]


@st.composite
def decides(draw) -> Ask:
    image = draw(st.sampled_from([None, *IMAGES]))
    questions = draw(st.lists(st.sampled_from(QUESTIONS), min_size=1, max_size=3))
    body = {"model": MODEL, "material": _message("Look at this.", image), "questions": questions}
    return Ask("decide", DECIDE, body, choices=len(questions))


def _refusals() -> list[Ask]:
    chat = {"model": MODEL, "messages": _message("Hi", None), "max_tokens": 2}
    completion = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    decide = {"model": MODEL, "material": _message("Look.", None), "questions": QUESTIONS[:1]}
    out = [Ask("refused", path, b"{not json", status=400) for path in (CHAT, COMPLETIONS, DECIDE)]
    out += [Ask("refused", path, {**body, "model": "gpt-4o"}, status=404)
            for path, body in ((CHAT, chat), (COMPLETIONS, completion), (DECIDE, decide))]
    bad_image = "data:image/png;base64,!!!notbase64"
    out += [Ask("refused", CHAT, {**chat, "messages": _message("x", bad_image)}, status=400),
            Ask("refused", DECIDE, {**decide, "material": _message("x", bad_image)}, status=400),
            Ask("refused", CHAT, {**chat, "max_tokens": 40_000}, status=400),
            Ask("refused", COMPLETIONS, {**completion, "max_tokens": 40_000}, status=400)]
    return out


refusals = st.sampled_from(_refusals())
disconnects = st.one_of(chats("disconnect", stream=True), completions("disconnect", stream=True)).map(
    lambda ask: replace(ask, what="disconnect"))
leavers = chats("leave", stream=False).map(lambda ask: replace(ask, what="leave"))
any_client = st.one_of(chats(), completions(), decides(), disconnects, leavers, refusals)


# -- what clients get -------------------------------------------------------------------------------------------------
def perform(url: str, ask: Ask) -> Counter:
    """Do `ask` as its client would; assert that what it got is well-formed. Returns the counters it must move."""
    content = ask.body if isinstance(ask.body, bytes) else json.dumps(ask.body).encode()
    post = {"content": content, "headers": {"content-type": "application/json"}}
    if ask.how == "disconnect":
        with httpx.stream("POST", url + ask.path, timeout=60, **post) as response:
            assert response.status_code == 200, f"{ask.what}: {response.status_code} {response.read()!r}"
            first = next(line for line in response.iter_lines() if line)
            assert first.startswith("data: {") and '"error"' not in first, f"{ask.what}: first event {first!r}"
        return Counter({("request_success", "abort"): ask.choices})  # left: the connection is closed unread
    if ask.how == "leave":
        try:
            # 1 s: the handler has read the body by then (a client gone before that was never a request), and its
            # LONG tokens are far from done
            response = httpx.post(url + ask.path, timeout=httpx.Timeout(30, read=1.0), **post)
        except httpx.ReadTimeout:
            return Counter({("request_success", "abort"): ask.choices})
        raise AssertionError(f"{ask.what}: answered before its client left: {response.status_code}")
    response = httpx.post(url + ask.path, timeout=60, **post)
    if ask.status != 200:
        return _refused(ask, response)
    if ask.may_fail and _failed(ask, response):
        ask = replace(ask, fails=True)
    if ask.fails and not ask.streamed:
        assert response.status_code == 500, f"{ask.what} under a failed step: {response.status_code} {response.text}"
        _internal_error(ask, response.json())
        return Counter({("request_success", "error"): 1})
    assert response.status_code == 200, f"{ask.what}: {response.status_code} {response.text}"
    if ask.streamed:
        return _streamed(ask, response.text)
    if ask.path == DECIDE:
        return _decided(ask, response.json())
    return _answered(ask, response.json())


def _refused(ask: Ask, response: httpx.Response) -> Counter:
    assert response.status_code == ask.status, f"{ask.what} {ask.body!r:.200}: {response.status_code} {response.text}"
    error = response.json().get("error")
    assert isinstance(error, dict) and error.get("message") and error.get("type"), f"not an error body: {response.text}"
    assert re.search(ask.message, error["message"]), f"{ask.what}: the refusal does not say {ask.message!r}: {error}"
    return Counter({("requests_rejected", str(ask.status)): 1})


def _failed(ask: Ask, response: httpx.Response) -> bool:
    """Whether `response` is a failed request's: a 500, or a stream holding an error event."""
    if not ask.streamed:
        return response.status_code == 500
    return any("error" in json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
               if line.startswith("data: {"))


def _internal_error(ask: Ask, answer: dict) -> None:
    ids = REQUEST_ID.findall(json.dumps(answer))
    assert len(ids) == 1 and answer == internal_error_body(ids[0]), f"{ask.what}: not the internal error: {answer}"


def _max_tokens(ask: Ask) -> int:
    return ask.body["max_tokens"]


def _check_usage(ask: Ask, usage: dict) -> None:
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    assert 0 < usage["prompt_tokens"] and usage["completion_tokens"] <= ask.choices * _max_tokens(ask), usage
    if ask.hits:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        assert cached > 0, f"{ask.what}: its prompt did not hit the prefix cache: {usage}"


def _asked_logprobs(ask: Ask) -> bool:
    return ask.body.get("logprobs") not in (None, False)  # chat: true; a text completion: how many alternatives


def _answered(ask: Ask, data: dict) -> Counter:
    """A chat or text completion's body: each choice once, in order, with a finish reason."""
    chat = ask.path == CHAT
    assert data["object"] == ("chat.completion" if chat else "text_completion"), data
    choices = data["choices"]
    assert [c["index"] for c in choices] == list(range(ask.choices)), f"{ask.what}: choices {choices}"
    for c in choices:
        assert c["finish_reason"] in ("stop", "length"), f"{ask.what}: {c}"
        text = c["message"]["content"] if chat else c["text"]
        assert isinstance(text, str) and (not chat or c["message"]["role"] == "assistant"), c
        assert (c["logprobs"] is not None) == _asked_logprobs(ask), f"{ask.what}: logprobs {c['logprobs']}"
    _check_usage(ask, data["usage"])
    return Counter(("request_success", c["finish_reason"]) for c in choices)


def _decided(ask: Ask, data: dict) -> Counter:
    assert data["object"] == "decision" and len(data["answers"]) == ask.choices, data
    for answer in data["answers"]:
        assert abs(sum(answer["probabilities"].values()) - 1) < 1e-4 and answer["answer"] in answer["probabilities"]
    return Counter({("decide_requests", "answered"): 1, ("decide_questions", ""): ask.choices})


def _streamed(ask: Ask, text: str) -> Counter:
    """SSE events ending in [DONE]; each choice's chunks end with the one holding its finish reason (a failed request:
    the internal error last); usage last when asked."""
    lines = [line for line in text.splitlines() if line]
    assert lines and all(line.startswith("data: ") for line in lines), f"{ask.what}: not SSE: {text[-500:]!r}"
    assert lines[-1] == "data: [DONE]", f"{ask.what}: the stream does not end with [DONE]: {lines[-1]!r}"
    assert lines.count("data: [DONE]") == 1, f"{ask.what}: [DONE] inside the stream"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    failed = [i for i, event in enumerate(events) if "error" in event]
    if ask.fails:
        assert failed == [len(events) - 1], f"{ask.what} under a failed step: error events at {failed} of {len(events)}"
        _internal_error(ask, events[-1])
        return Counter({("request_success", "error"): 1})
    assert not failed, f"{ask.what}: error events {[events[i] for i in failed]}"
    if (ask.body.get("stream_options") or {}).get("include_usage"):
        assert events and events[-1]["choices"] == [] and events[-1]["usage"], f"{ask.what}: no usage last"
        _check_usage(ask, events.pop()["usage"])
    kind = "chat.completion.chunk" if ask.path == CHAT else "text_completion"
    finished: dict[int, str] = {}
    for event in events:
        assert event["object"] == kind and len(event["choices"]) == 1 and not event.get("usage"), event
        (choice,) = event["choices"]
        assert 0 <= choice["index"] < ask.choices, f"{ask.what}: choice {choice['index']} of {ask.choices}"
        assert choice["index"] not in finished, f"{ask.what}: a chunk of choice {choice['index']} after its finish"
        if choice["finish_reason"] is not None:
            assert choice["finish_reason"] in ("stop", "length"), choice
            finished[choice["index"]] = choice["finish_reason"]
    assert sorted(finished) == list(range(ask.choices)), f"{ask.what}: finish reasons {finished}"
    return Counter(("request_success", reason) for reason in finished.values())


def together(url: str, asks: list[Ask]) -> Counter:
    """`asks` at once, one thread each; the first failure re-raised once all are done."""
    outcomes: list[Counter | BaseException | None] = [None] * len(asks)

    def client(i: int) -> None:
        try:
            outcomes[i] = perform(url, asks[i])
        except BaseException as error:  # noqa: BLE001 - re-raised below, in the machine's thread
            outcomes[i] = error

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for ask, outcome in zip(asks, outcomes, strict=True):
        if isinstance(outcome, AssertionError):
            raise outcome
        if not isinstance(outcome, Counter):
            raise AssertionError(f"{ask.what} beside {[a.what for a in asks]}: {outcome!r}") from outcome
    return sum(outcomes, Counter())
