"""A 500 over real HTTP (uvicorn in a thread, the tiny checkpoint) says that the server failed and under which request
id, never what failed: the engine failing a request (a lost step, a failing engine thread), a handler raising before
it submits, a response or a stream failing to render, an exception outside every handler. The log names the id with
the failure. Refusals (4xx) keep their own messages."""

from __future__ import annotations

import base64
import io
import json
import logging
import re

import httpx
import pytest
from PIL import Image

from prism.serving.settings import ServerSettings
from prism.testing.serving import failing_at, requests_left_after, serve_in_thread

MODEL = "prism-tiny"
SECRET = "SECRET /opt/models/qwen internals"
REQUEST_ID = re.compile(r"req-[0-9a-f]{32}")


@pytest.fixture(scope="module")
def live():
    server = serve_in_thread(ServerSettings())
    yield server
    server.stop()


def _internal_error(body: dict) -> str:
    """The request id of a generic 500 body (AssertionError if it is not one)."""
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == ("server_error", "internal_error", None), body
    ids = REQUEST_ID.findall(error["message"])
    assert len(ids) == 1, f"no request id in {error['message']!r}"
    return ids[0]


def _logged(caplog, request_id: str) -> str:
    """Everything logged under `request_id`: messages and tracebacks."""
    return "\n".join(f"{r.getMessage()}\n{r.exc_text or ''}" for r in caplog.records if request_id in r.getMessage())


def _post(live, path: str, body: dict, stream: bool) -> httpx.Response:
    return httpx.post(live.url + path, json={**body, "stream": True} if stream else body, timeout=60)


def _check_500(response: httpx.Response, caplog, stream: bool) -> str:
    """The response is the generic 500 (a stream: its error event, then [DONE]), its id logged with the failure."""
    assert SECRET not in response.text, response.text
    if stream:
        assert response.status_code == 200, response.text
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
        assert events[-1] == "[DONE]", events[-3:]
        request_id = _internal_error(json.loads(events[-2]))
    else:
        assert response.status_code == 500, response.text
        request_id = _internal_error(response.json())
        assert response.headers["x-request-id"] == request_id
    assert SECRET in _logged(caplog, request_id), f"the log has no {request_id} with the failure: {caplog.text}"
    return request_id


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (5, 6, 7)).save(buf, format="PNG")
    return buf.getvalue()


CHAT = ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
PNG_URL = "data:image/png;base64," + base64.b64encode(_png()).decode()
EPS_URL = "data:image/eps;base64," + base64.b64encode(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n").decode()
COMPLETION = ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETION], ids=["chat", "completion"])
@pytest.mark.parametrize("where", ["lost step", "engine thread"])
def test_a_request_the_engine_fails_is_a_500_naming_only_a_request_id(live, caplog, where, endpoint, stream):
    """Before: the engine's reason went out as the message ("RuntimeError: <the exception's text>", "engine failure:
    <...>"), in the JSON body and in a stream's error event."""
    owner, name = (live.engine.runner, "execute") if where == "lost step" else (live.engine, "step")
    with caplog.at_level(logging.ERROR), failing_at(owner, name, RuntimeError(SECRET)):
        response = _post(live, *endpoint, stream)
    _check_500(response, caplog, stream)


def test_a_decide_the_engine_fails_is_a_500_naming_only_a_request_id(live, caplog):
    """Before: 500 "question 0 failed: RuntimeError: <the exception's text>"."""
    body = {"model": MODEL, "material": [{"role": "user", "content": "Hi"}],
            "questions": [{"type": "yes_no", "text": "Is it?"}]}
    with caplog.at_level(logging.ERROR), failing_at(live.engine.runner, "execute", RuntimeError(SECRET)):
        response = _post(live, "/v1/decide", body, stream=False)
    _check_500(response, caplog, stream=False)


def test_a_handler_failing_before_it_submits_logs_its_traceback_under_the_id(live, caplog):
    """Before: 500 "internal server error", with nothing to find it by in the log."""
    inputs = live.engine.inputs
    with caplog.at_level(logging.ERROR), failing_at(inputs, "prepare_chat", RuntimeError(SECRET)):
        response = _post(live, *CHAT, stream=False)
    request_id = _check_500(response, caplog, stream=False)
    assert "Traceback" in _logged(caplog, request_id) and "prepare_chat" not in response.text
    assert not live.engine.requests


def test_a_response_that_fails_to_render_is_a_json_500(live, caplog):
    """A ValueError while the answer is built is the server's failure, not a 400. Before: Starlette's plain-text
    "Internal Server Error", not an OpenAI body."""
    from prism.serving import app

    with caplog.at_level(logging.ERROR), failing_at(app, "build_response", ValueError(SECRET)):
        response = _post(live, *CHAT, stream=False)
    _check_500(response, caplog, stream=False)


def test_a_stream_that_fails_to_render_midway_ends_with_an_error_event_then_done(live, caplog):
    """Before: the connection was cut mid-stream (no error event, no [DONE]: "incomplete chunked read")."""
    from prism.serving.stream import ChatCompletionStream

    body = {**CHAT[1], "max_tokens": 8, "ignore_eos": True}
    with caplog.at_level(logging.ERROR), failing_at(ChatCompletionStream, "on_output", KeyError(SECRET), at_call=2):
        response = _post(live, CHAT[0], body, stream=True)
    _check_500(response, caplog, stream=True)


def test_a_failure_outside_every_handler_is_a_json_500(live, caplog):
    """Before: Starlette's plain-text "Internal Server Error"."""
    from prism.serving import app

    with caplog.at_level(logging.ERROR), failing_at(app, "generate_latest", RuntimeError(SECRET)):
        response = httpx.get(live.url + "/metrics", timeout=30)
    request_id = _check_500(response, caplog, stream=False)
    assert "Traceback" in _logged(caplog, request_id)


@pytest.mark.parametrize("body, status, words", [
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]}, 404, "does not exist"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10**6}, 400, "context"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [  # before: an OverflowError, a 500
        {"type": "video", "video": {"frames": [PNG_URL] * 4, "fps": 5e-324}}]}]}, 400, "video_fps"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [  # before: decoded by running Ghostscript
        {"type": "image_url", "image_url": {"url": EPS_URL}}]}]}, 400, "not a decodable image"),
])
def test_refusals_keep_their_messages(live, body, status, words):
    response = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == status and words in response.json()["error"]["message"], response.text
    assert not REQUEST_ID.search(response.text)


def _png_claiming(width: int, height: int, colour: int) -> bytes:
    """A PNG whose header claims width x height over a few bytes of pixel data: decoding it would fail (truncated), so
    a 413 for it came from its header alone."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress(bytes([0, colour, colour, colour]) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def _image_parts(*pngs: bytes) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()}}
            for p in pngs]


@pytest.mark.parametrize("endpoint", ["chat", "decide"])
def test_images_past_the_pixel_budget_are_a_413_naming_it_and_leave_nothing(live, endpoint):
    """Four images of 9000 x 9000 (each under the per-image limit of ~89 M pixels) announce 324 M pixels, more than
    the default max_image_pixels (2**28: 16 images of 4096 x 4096): a 413 naming the limit, the request's total and
    the image that crosses it, before any is decoded; nothing cached (decoded data URLs, preprocessed images), no
    engine request."""
    state = live.app.state.prism
    assert state.resolver.max_image_pixels == state.settings.max_image_pixels == 2**28
    data_urls, preprocessed = state.resolver._decoded.nbytes, len(live.engine.inputs.cache)
    content = [*_image_parts(*(_png_claiming(9000, 9000, colour) for colour in range(4))),
               {"type": "text", "text": "What are they?"}]
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}]}
        where = "messages[0].content[3].image_url.url"
    else:
        path, body = "/v1/decide", {"model": MODEL, "material": [{"role": "user", "content": content}],
                                    "questions": [{"type": "yes_no", "text": "Are they flat?"}]}
        where = "material[0].content[3].image_url.url"
    response = httpx.post(live.url + path, json=body, timeout=60)
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["message"] == (
        "the images of this request announce 324000000 pixels in all; the limit is max_image_pixels=268435456, "
        "crossed at image 3 (9000x9000): refused before decoding any"), error
    assert (error["param"], error["code"]) == (where, "request_too_large"), error
    assert state.resolver._decoded.nbytes == data_urls and len(live.engine.inputs.cache) == preprocessed
    assert not live.engine.requests


def test_a_server_refuses_at_its_engines_pixel_budget_where_that_is_lower(tmp_path):
    """PRISM_CONFIG's max_image_pixels (and max_video_pixels) below the server's: the resolver refuses at it (a 413
    before the data URLs are cached), not the engine after them."""
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"max_image_pixels": 1000, "max_video_pixels": 40 * 30 * 3}))
    server = serve_in_thread(ServerSettings(engine_config_path=config))
    try:
        state = server.app.state.prism
        assert (state.settings.max_image_pixels, state.resolver.max_image_pixels) == (2**28, 1000)
        assert (state.settings.max_video_pixels, state.resolver.max_video_pixels) == (2**27, 40 * 30 * 3)
        body = {"model": MODEL, "messages": [{"role": "user", "content": _image_parts(_png(), _png())}],
                "max_tokens": 2}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 413 and "max_image_pixels=1000" in response.json()["error"]["message"]
        assert state.resolver._decoded.nbytes == 0 and len(server.engine.inputs.cache) == 0
        frames = [part["image_url"]["url"] for part in _image_parts(*[_png()] * 4)]
        video = {"type": "video", "video": {"frames": frames, "fps": 2.0}}
        body = {**body, "messages": [{"role": "user", "content": [video]}]}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 413 and "max_video_pixels=3600" in response.json()["error"]["message"]
        assert state.resolver._decoded.nbytes == 0 and len(server.engine.inputs.cache) == 0
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_of_several_failing_while_its_events_are_read_ends_the_completion(live, caplog, stream):
    """n = 2, the metrics' observer of a choice raising at the completion's third event. Before: the choice's pump
    task died with the exception unseen and the merge waited for its events forever (no answer, stream or not)."""
    from prism.serving.metrics import RequestTracker

    body = {**CHAT[1], "max_tokens": 8, "ignore_eos": True, "n": 2}
    with caplog.at_level(logging.ERROR), failing_at(RequestTracker, "__call__", RuntimeError(SECRET), at_call=3):
        try:
            response = httpx.post(live.url + CHAT[0], json={**body, "stream": True} if stream else body, timeout=15)
        except httpx.ReadTimeout:
            pytest.fail("no answer 15 s after the request")
    _check_500(response, caplog, stream)
    assert not requests_left_after(live.engine, 5)
