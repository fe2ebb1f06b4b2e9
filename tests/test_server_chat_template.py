"""A model without a chat template, served for real (the tiny checkpoint with its template removed, uvicorn in a
thread): the start logs a WARNING naming the model and what is refused; chat completions (plain and streamed) and
decides are a 400 naming the missing template, before any media is fetched; text completions work. The tiny
checkpoint with its template logs no such warning."""

from __future__ import annotations

import json
import logging
import shutil

import httpx
import pytest

from prism.serving.settings import ServerSettings
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.serving import serve_in_thread

NAME = "no-template"
TEMPLATE_WARNING = "has no chat template"


def _without_chat_template(root) -> None:
    """Remove every place a checkpoint may keep its template (`engine/chat.py` `load_chat_template`)."""
    for name in ("chat_template.jinja", "chat_template.json"):
        (root / name).unlink(missing_ok=True)
    config = json.loads((root / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (root / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the server, the WARNING records its start logged)."""
    root = tmp_path_factory.mktemp("ckpt") / NAME
    shutil.copytree(ensure_tiny_checkpoint(), root)
    _without_chat_template(root)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("prism").addHandler(handler)
    try:
        server = serve_in_thread(ServerSettings(model_dir=root, allow_remote_media=True))
    finally:
        logging.getLogger("prism").removeHandler(handler)
    yield server, records
    server.stop()


def _refused(response: httpx.Response, endpoint: str) -> None:
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert f"the model {NAME!r} has no chat template" in message and endpoint in message, message
    assert "/v1/completions" in message, f"the message does not say what works: {message}"
    assert str(ensure_tiny_checkpoint().parent) not in message, f"the server's paths in a client's error: {message}"


def test_the_start_warns_naming_the_model_and_what_is_refused(served):
    _, records = served
    warnings = [r for r in records if TEMPLATE_WARNING in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in records]
    assert warnings[0].levelno == logging.WARNING, warnings[0].levelname
    warning = warnings[0].getMessage()
    assert warning.startswith(f"the model {NAME} ("), warning
    for refused in ("/v1/chat/completions", "/v1/decide", "/v1/completions (raw prompts) works"):
        assert refused in warning, warning


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_are_a_400_naming_the_missing_template(served, stream):
    server, _ = served
    # An image URL nothing answers: refused before the media are resolved, the request fails at once with the 400.
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}},
                                             {"type": "text", "text": "Hi"}]}]
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"model": NAME, "messages": messages, "max_tokens": 2, "stream": stream})
    _refused(response, "/v1/chat/completions")


def test_decides_are_a_400_naming_the_missing_template(served):
    server, _ = served
    response = httpx.post(server.url + "/v1/decide", timeout=60, json={
        "model": NAME, "material": [{"role": "user", "content": "It rains."}],
        "questions": [{"type": "yes_no", "text": "Is it raining?"}]})
    _refused(response, "/v1/decide")


def test_text_completions_work(served):
    server, _ = served
    response = httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"model": NAME, "prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_a_model_with_a_template_starts_without_the_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="prism"):
        server = serve_in_thread(ServerSettings(model_dir=ensure_tiny_checkpoint()))
    try:
        assert TEMPLATE_WARNING not in caplog.text, caplog.text
        response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": ensure_tiny_checkpoint().name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert response.status_code == 200, response.text
    finally:
        server.stop()
