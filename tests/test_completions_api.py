"""`POST /v1/completions` (the legacy text API) and `GET /v1/models/{id}`: the request's validation, then the real
server on the tiny checkpoint through the official `openai` client: prompt forms, choice numbering, echo, legacy
logprobs, streaming equal to the whole answer, usage, refusals, and no request left behind."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI

from prism.serving.completions import DEFAULT_MAX_TOKENS, parse_completion_request
from prism.serving.protocol import ProtocolError
from prism.serving.settings import ServerSettings
from prism.testing.serving import requests_left_after, serve_in_thread

MODEL = "prism-tiny"


# ------------------------------------------------------------------------------------------ parsing
@pytest.mark.parametrize("prompt, prompts", [
    ("Hello", ["Hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_forms(prompt, prompts):
    assert parse_completion_request({"model": MODEL, "prompt": prompt}).prompts == prompts


@pytest.mark.parametrize("changes, param, words", [
    ({"prompt": []}, "prompt", "non-empty list"),
    ({"prompt": [1, "a"]}, "prompt", "list of such lists"),
    ({"prompt": [-1]}, "prompt", "non-negative"),
    ({"prompt": [True]}, "prompt", "token ids"),
    ({"prompt": [[]]}, "prompt", "non-empty"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": ["x"] * 129}, "prompt", "at most 128"),
    ({"suffix": "end"}, "suffix", "not supported"),
    ({"best_of": 3}, "best_of", "equal to n"),
    ({"echo": True, "logprobs": 1}, "echo", "prompt's logprobs"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"logprobs": True}, "logprobs", "valid integer"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"logit_bias": {"1": -101}}, "logit_bias", "must be in [-100, 100]"),
    ({"messages": []}, "messages", "unknown or unsupported field"),
])
def test_bad_fields_are_refused_with_their_name(changes, param, words):
    with pytest.raises(ProtocolError) as caught:
        parse_completion_request({"model": MODEL, "prompt": "Hi", **changes})
    assert caught.value.param == param and words in caught.value.message, caught.value.message


def test_max_tokens_default_and_context():
    request = parse_completion_request({"model": MODEL, "prompt": "Hi", "seed": -2})
    assert request.params_for(10, 1000).max_tokens == DEFAULT_MAX_TOKENS
    assert request.params_for(995, 1000).max_tokens == 5, "the default is cut to what the context holds"
    assert request.params_for(10, 1000).seed == 2**64 - 2
    explicit = parse_completion_request({"model": MODEL, "prompt": "Hi", "max_tokens": 50})
    with pytest.raises(ProtocolError, match="context is 1000 tokens"):
        explicit.params_for(960, 1000)


# ------------------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def live():
    server = serve_in_thread(ServerSettings())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return OpenAI(base_url=live.url + "/v1", api_key="unused")


def test_a_string_prompt_and_its_token_ids_complete_alike(live, client):
    text = "The sky is"
    ids = live.engine.inputs.encode(text)
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0, extra_body={
        "ignore_eos": True})
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body={
        "ignore_eos": True})
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")
    assert by_text.choices[0].text == by_ids.choices[0].text and by_text.choices[0].finish_reason == "length"
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 6
    # greedy: the engine's own answer to the same raw prompt, no chat template around it
    prompt = live.engine.inputs.prepare_prompt(text)
    assert prompt.token_ids == ids


def test_default_max_tokens_is_sixteen(client):
    out = client.completions.create(model=MODEL, prompt="Count:", temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == DEFAULT_MAX_TOKENS


def test_choices_are_numbered_prompt_by_prompt(client):
    out = client.completions.create(model=MODEL, prompt=["One", "Two words"], n=2, max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    greedy = [c.text for c in out.choices]
    assert greedy[0] == greedy[1] and greedy[2] == greedy[3], "greedy choices of one prompt are equal"
    alone = client.completions.create(model=MODEL, prompt="Two words", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert alone.choices[0].text == greedy[2]
    assert out.usage.prompt_tokens == alone.usage.prompt_tokens + client.completions.create(
        model=MODEL, prompt="One", max_tokens=1).usage.prompt_tokens, "each prompt counted once"
    assert out.usage.completion_tokens == 4 * 3


def test_echo_puts_the_prompt_first(live, client):
    out = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert out.choices[0].text == "Echo me" + plain.choices[0].text
    ids = live.engine.inputs.encode("<|im_start|>user")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True)
    assert by_ids.choices[0].text.startswith("<|im_start|>user"), "token ids echo as their text, specials kept"


def test_legacy_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Logprobs", max_tokens=5, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token in top and top[token] == chosen and len(top) <= 3
        assert chosen == max(top.values()), "greedy picks the most likely token"
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens, strict=False))


def test_streaming_equals_the_whole_answer(client):
    kwargs = dict(model=MODEL, prompt=["Stream A", "Stream B"], n=2, max_tokens=5, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts, tokens, reasons = [""] * 4, [[] for _ in range(4)], [None] * 4
    for chunk in chunks[:-1]:
        assert chunk.object == "text_completion" and chunk.usage is None
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        tokens[choice.index] += choice.logprobs.tokens if choice.logprobs else []
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.text for c in whole.choices]
    assert tokens == [c.logprobs.tokens for c in whole.choices]
    assert reasons == ["length"] * 4
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_refusals(live):
    def post(body: dict) -> httpx.Response:
        return httpx.post(live.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)

    vocab = live.engine.inputs.tokenizer.get_vocab_size(with_added_tokens=True)
    image_pad = live.engine.inputs.special.image_pad
    for body, status, words in (
        ({"model": "other", "prompt": "Hi"}, 404, "does not exist"),
        ({"prompt": "A picture: <|vision_start|><|image_pad|><|vision_end|>"}, 400, "image placeholders"),
        ({"prompt": [1, vocab]}, 400, "vocabulary"),
        ({"prompt": [1, image_pad]}, 400, "placeholder"),
        ({"prompt": "Hi", "max_tokens": live.engine.max_model_len}, 400, "context"),
        ({"prompt": "Hi", "n": 2, "best_of": 1}, 400, "best_of"),
    ):
        response = post(body)
        assert response.status_code == status, (body, response.text)
        assert words in response.json()["error"]["message"], response.text
        assert response.json()["error"]["code"] == ("model_not_found" if status == 404 else None), response.text
    assert not requests_left_after(live.engine, 2)


def test_model_by_id(live):
    card = httpx.get(f"{live.url}/v1/models/{MODEL}", timeout=10)
    assert card.status_code == 200 and card.json()["id"] == MODEL and card.json()["object"] == "model"
    missing = httpx.get(f"{live.url}/v1/models/gpt-4o", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert OpenAI(base_url=live.url + "/v1", api_key="unused").models.retrieve(MODEL).id == MODEL


def test_text_offset_indexes_the_text_across_split_characters_and_skipped_specials():
    """Review (session 28): offsets were the running sum of each token's own text, so a character split over two
    byte tokens counted twice and a special token the text leaves out counted its whole name."""
    from prism.engine.request import RequestOutput, TokenLogprobs
    from prism.serving.completions import LegacyLogprobs

    pieces = {1: "é".encode()[:1], 2: "é".encode()[1:], 3: b"ab", 4: b"<|im_end|>", 5: b"c"}
    logprobs = LegacyLogprobs(pieces.__getitem__, offset=3, skipped={4})  # after an echoed prompt of 3 characters
    event = RequestOutput("r", [1, 2, 3, 4, 5], "éabc", False,
                          logprobs=[TokenLogprobs(t, -1.0, []) for t in (1, 2, 3, 4, 5)])
    out = logprobs.of(event)
    text = "abc" + "éabc"
    assert out.text_offset == [3, 3, 4, 6, 6]
    assert [text[o] for o in out.text_offset] == ["é", "é", "a", "c", "c"]


def test_text_offset_counts_a_cut_character_before_the_token_that_cuts_it():
    """Found by the review of the streamed text: the U+FFFD of an incomplete character cut by a token's first byte
    counted only after that token, whose own text then did not start at its offset."""
    from prism.engine.request import RequestOutput, TokenLogprobs
    from prism.serving.completions import LegacyLogprobs

    pieces = {1: b"\xe4", 2: b"a", 3: b"\xe4\xbd", 4: b"\xa0b", 5: b"\xf0\x9f", 6: b"\xe4", 7: b"<|im_end|>", 8: b"c",
              9: b"\xbd"}
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    logprobs = LegacyLogprobs(pieces.__getitem__, offset=0, skipped={7})
    out = logprobs.of(RequestOutput("r", ids, "", False, logprobs=[TokenLogprobs(t, -1.0, []) for t in ids]))
    text = b"".join(pieces[t] for t in ids if t != 7).decode("utf-8", "replace")
    assert text == "\ufffda你b\ufffd\ufffdc"
    # "a" after the cut "\xe4"; "\xa0b" completes 你 (counted at it); "\xe4" cuts "\xf0\x9f"; the special token comes
    # after the characters known complete ("\xe4" still pending), "c" after that "\xe4", which it cuts.
    assert out.text_offset == [0, 1, 2, 2, 4, 5, 5, 6]
    # A prompt ending inside a character: the text starts by completing it.
    logprobs = LegacyLogprobs(pieces.__getitem__, offset=0, tail=b"\xe4")
    out = logprobs.of(RequestOutput("r", [9, 2], "", False, logprobs=[TokenLogprobs(t, -1.0, []) for t in (9, 2)]))
    assert out.text_offset == [0, 1]  # "\xe4" + "\xbd" + "a": one U+FFFD (cut by "a"), then "a"


def test_prompt_limits_are_checked_before_anything_else():
    """Review (session 28): a 59 MB body of token ids was checked id by id before its length; a 57 MB string was
    tokenized (112 s holding the GIL) before its length was known to be too much."""
    with pytest.raises(ProtocolError, match="prompt 0 has 1001 token ids; the limit is 1000"):
        parse_completion_request({"model": MODEL, "prompt": [1] * 1001}, max_prompt_tokens=1000)
    with pytest.raises(ProtocolError, match="prompt 1 has 5000 characters"):
        parse_completion_request({"model": MODEL, "prompt": ["ok", "x" * 5000]}, 1000, max_prompt_chars=4000)
    assert parse_completion_request({"model": MODEL, "prompt": [[1] * 1000]}, 1000, 4000).prompts == [[1] * 1000]


def test_long_prompts_are_refused_quickly_and_name_their_prompt(live):
    inputs = live.engine.inputs
    started = time.perf_counter()
    too_many = httpx.post(live.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "word " * (inputs.max_prompt_chars // 5 + 1)})
    assert too_many.status_code == 400 and "characters" in too_many.json()["error"]["message"], too_many.text
    assert time.perf_counter() - started < 10, "refused only after tokenizing"
    second = httpx.post(live.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": ["fine", "<|vision_start|><|image_pad|><|vision_end|>"]})
    assert second.status_code == 400 and second.json()["error"]["param"] == "prompt", second.text
    assert second.json()["error"]["message"].startswith("prompt 1: "), second.text


def test_a_prompt_is_counted_once_in_the_metrics_however_many_choices(live, client):
    def prompt_tokens() -> float:
        return sum(float(line.split()[-1]) for line in httpx.get(live.url + "/metrics").text.splitlines()
                   if line.startswith("prism:prompt_tokens_total"))

    before = prompt_tokens()
    out = client.completions.create(model=MODEL, prompt=["One", "Two words"], n=3, max_tokens=1)
    deadline = time.time() + 10
    while prompt_tokens() < before + out.usage.prompt_tokens and time.time() < deadline:
        time.sleep(0.05)
    assert prompt_tokens() - before == out.usage.prompt_tokens
    rejected = httpx.get(live.url + "/metrics").text.count('status="404"')
    assert httpx.get(live.url + "/v1/models/unknown").status_code == 404
    assert httpx.get(live.url + "/metrics").text.count('status="404"') == rejected, "a lookup is not a refusal"


def test_top_logprobs_list_each_text_with_its_most_likely_token_and_the_chosen_with_its_own():
    """Found hunting the streamed text: of tokens of equal text, the last (least likely) one's logprob was kept, so
    the byte tokens of a split character (all U+FFFD) listed the chosen token with a runner-up's logprob."""
    from prism.engine.request import RequestOutput, TokenLogprobs
    from prism.serving.completions import LegacyLogprobs

    pieces = {1: b"\xe4", 2: b"\xe5", 3: b"\xe6", 4: b"a"}
    logprobs = LegacyLogprobs(pieces.__getitem__, offset=0)
    greedy = TokenLogprobs(1, -0.1, [(1, -0.1), (2, -2.0), (4, -3.0), (3, -4.0)])
    sampled = TokenLogprobs(3, -4.0, [(2, -0.5), (4, -1.0), (3, -4.0)])
    out = logprobs.of(RequestOutput("r", [1, 3], "", False, logprobs=[greedy, sampled]))
    assert out.top_logprobs == [{"\ufffd": -0.1, "a": -3.0}, {"\ufffd": -4.0, "a": -1.0}]
    assert [top[t] for t, top in zip(out.tokens, out.top_logprobs, strict=True)] == out.token_logprobs
