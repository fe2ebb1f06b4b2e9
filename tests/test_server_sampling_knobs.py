"""The sampling knobs over HTTP for real (uvicorn in a thread, the tiny checkpoint, the official `openai` client):
presence / frequency penalties and logit_bias as OpenAI's fields, min_p and repetition_penalty in `extra_body`, on
both completion endpoints, streamed or not; values out of range are a 400 naming the field, and harm nothing."""

from __future__ import annotations

import httpx
import pytest

from prism.engine.sampling import SamplingParams
from prism.serving.settings import ServerSettings
from prism.testing.serving import serve_in_thread

MODEL = "prism-tiny"
HI = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def live():
    server = serve_in_thread(ServerSettings())
    yield server
    server.stop()


@pytest.fixture
def seen(live, monkeypatch) -> list[SamplingParams]:
    """The SamplingParams of every engine request the server makes."""
    params: list[SamplingParams] = []
    add_request = live.engine.add_request

    def recording(request_id, prompt, p=None):
        params.append(p)
        return add_request(request_id, prompt, p)

    monkeypatch.setattr(live.engine, "add_request", recording)
    return params


@pytest.fixture
def client(live):
    from openai import OpenAI

    with OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_the_model_cards_request_and_every_knob_reach_the_engine(client, seen):
    """Qwen3-VL's recommended Instruct request (presence_penalty=1.5), then every knob at once, streamed."""
    out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0.7, top_p=0.8,
                                         presence_penalty=1.5, extra_body={"top_k": 20, "repetition_penalty": 1.0})
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    assert (seen[-1].presence_penalty, seen[-1].top_k, seen[-1].repetition_penalty) == (1.5, 20, 1.0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=6, stream=True, seed=3, presence_penalty=-0.5, frequency_penalty=1.2,
        logit_bias={"17": -100, "42": 3}, extra_body={"min_p": 0.05, "repetition_penalty": 1.3}))
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    p = seen[-1]
    assert (p.presence_penalty, p.frequency_penalty, p.min_p, p.repetition_penalty, p.seed) == (-0.5, 1.2, 0.05, 1.3, 3)
    assert p.logit_bias == ((17, -100.0), (42, 3.0))
    client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, frequency_penalty=0.7,
                              logit_bias={"9": 1}, extra_body={"min_p": 0.2})
    assert (seen[-1].frequency_penalty, seen[-1].min_p, seen[-1].logit_bias) == (0.7, 0.2, ((9, 1.0),))


def test_a_logit_bias_of_100_forces_its_token_and_a_penalty_leaves_the_first_token(live, client):
    token = 300
    text = live.engine.inputs.tokenizer.decode([token] * 5)
    forced = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, temperature=1.0, seed=1,
                                            logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].message.content == text
    # The first token has no output before it: presence and frequency penalties (over the output only) leave it.
    greedy = dict(model=MODEL, messages=HI, max_tokens=1, temperature=0, logprobs=True)
    plain = client.chat.completions.create(**greedy).choices[0].logprobs.content[0]
    penalized = client.chat.completions.create(**greedy, presence_penalty=2, frequency_penalty=2).choices[0]
    assert (penalized.logprobs.content[0].token, penalized.logprobs.content[0].logprob) == (plain.token, plain.logprob)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("field, value, words", [
    ("presence_penalty", 2.5, "presence_penalty: Input should be less than or equal to 2"),
    ("frequency_penalty", -3, "frequency_penalty: Input should be greater than or equal to -2"),
    ("repetition_penalty", 0, "repetition_penalty: Input should be greater than 0"),
    ("min_p", 1.5, "min_p: Input should be less than or equal to 1"),
    ("logit_bias", {"5": 101}, "logit_bias: the bias of token 5 must be in [-100, 100]"),
    ("logit_bias", {"five": 1}, "logit_bias: keys are token ids written in digits"),
    ("logit_bias", {"5000000": 1}, "logit_bias token ids must be below the vocabulary size"),
])
def test_a_knob_out_of_range_is_a_400_naming_it(live, path, field, value, words):
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body.update({"messages": HI} if path == "/v1/chat/completions" else {"prompt": "Hi"})
    response = httpx.post(live.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"], response.json()
    ok = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200 and not live.engine.has_unfinished_requests()
