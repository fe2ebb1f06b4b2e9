"""Spec of what a client reads of a generation: the engine's text, tokens and logprobs rendered as OpenAI's chat and
legacy completions, streamed or not, on the real server (tiny checkpoint, CPU), its tokens scripted
(`prism.testing.scripted_tokens`) so that the text holds multi-byte characters split over byte tokens, and so that
each token has likely alternatives, often byte tokens of the same text (U+FFFD). The legacy prompt is "Hi" or token
ids that may end inside a character, which the scripted tokens may complete.

Invariant: for each choice, with `full` the decode of its prompt and the tokens the script gives it up to its budget or
up to its first stop token (an EOS not ignored, a stop token id), that token's own text left out, and `whole` the
prompt's text without an incomplete last character:
- its text streamed (the concatenation of its deltas) is its text not streamed, which is `full` after `whole`, cut
  before its first stop string, after the echoed prompt (`whole`) under `echo`: echo and text are the decode of the
  prompt and the tokens together; its finish reason is "stop" exactly when that text holds a stop string or a stop
  token ended it, and the same streamed or not;
- its logprobs have one entry per generated token, the same streamed or not; in the legacy layout `text_offset[i]` is
  the number of characters of its text made wholly of bytes before token i (a character ends in the token holding its
  last byte: the one completing it, or for an invalid one the one before the byte that cuts it; a token without bytes,
  a special token the text leaves out, comes after the characters known to be complete by then), and `top_logprobs[i]`
  lists the chosen token's text with its own logprob (`token_logprobs[i]`) and any other text with its most likely
  token's (greedy: the chosen's is the highest);
- usage counts the generated tokens of every choice, the same streamed or not.
"""

from __future__ import annotations

import functools
import json

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.serving.settings import ServerSettings
from prism.testing.scripted_tokens import scripted_tokens
from prism.testing.serving import serve_in_thread

MODEL = "prism-tiny"
# Characters of one to four UTF-8 bytes, which byte-level BPE splits across tokens.
CHARACTERS = st.sampled_from(list("ab k.") + ["é", "你", "好", "쀍", "€", "😀", "𝔘"])
# Logits of a token's alternatives, below the scripted token's 0.
ALTERNATIVE_LOGITS = st.sampled_from([-0.5, -1.0, -2.0, -4.0])
FFFD = "\ufffd"


@functools.lru_cache(maxsize=1)
def server():
    return serve_in_thread(ServerSettings())  # a daemon thread: it ends with the process


@st.composite
def scripts(draw: st.DrawFn
            ) -> tuple[list[int], list[dict[int, float]], int, tuple[str, ...], tuple[int, ...], str | list[int]]:
    """(the scripted tokens, each one's alternatives by logit, the budget, the stop strings, the stop token ids, the
    legacy prompt): the tokens of a drawn text, one maybe dropped and bytes above 0x7f maybe put in (cutting
    characters), maybe an EOS put in (or one of its tokens made a stop token id); alternatives mostly bytes above 0x7f (one of a split character reads
    U+FFFD, as the scripted token often does); stop strings mostly from the budget's text. The legacy prompt: "Hi", or
    the token ids of "Hi" and a character, its last bytes often left to the scripted tokens (which then complete it)
    or cut off."""
    inputs = server().engine.inputs
    tok = inputs.tokenizer
    # Byte-level BPE names the bytes 0xa1-0xff but 0xad by their own characters: lead and continuation bytes.
    high_bytes = [tok.token_to_id(chr(b)) for b in range(0xA1, 0x100) if b != 0xAD]
    tokens = tok.encode(draw(st.lists(CHARACTERS, min_size=1, max_size=8).map("".join))).ids
    if len(tokens) > 1 and draw(st.booleans()):
        del tokens[draw(st.integers(0, len(tokens) - 1))]
    for _ in range(draw(st.integers(0, 2))):
        tokens.insert(draw(st.integers(0, len(tokens))), draw(st.sampled_from(high_bytes)))
    prompt: str | list[int] = "Hi"
    if draw(st.booleans()):
        prompt = tok.encode("Hi" + draw(CHARACTERS)).ids
        cut = draw(st.integers(0, len(prompt) - 1))
        if cut and draw(st.booleans()):
            tokens = prompt[len(prompt) - cut :] + tokens
        prompt = prompt[: len(prompt) - cut]
    ends = draw(st.sampled_from(["budget", "budget", "eos", "stop token id"]))
    stop_token_ids = ()
    if ends != "budget":
        stop_token_ids = (inputs.eos_token_ids[0] if ends == "eos" else draw(st.sampled_from(tokens)),)
        if draw(st.booleans()):
            tokens.insert(draw(st.integers(0, len(tokens))), stop_token_ids[0])
    alternative = st.one_of(st.sampled_from(high_bytes), st.sampled_from(tokens))
    alternatives = [{t: logit for t, logit in draw(st.dictionaries(alternative, ALTERNATIVE_LOGITS, max_size=3)).items()
                     if t != own} for own in tokens]
    budget = draw(st.integers(1, len(tokens)))
    text = tok.decode(tokens[:budget])
    stops = []
    for _ in range(draw(st.integers(0, 2))):
        if text and draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start : draw(st.integers(start + 1, min(len(text), start + 3)))])
        else:
            stops.append("zz")
    return tokens, alternatives, budget, tuple(stops), stop_token_ids, prompt


def _events(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", f"the stream did not end with [DONE]: {response.text[-200:]!r}"
    return [json.loads(line) for line in lines[:-1]]


def _post(path: str, body: dict) -> tuple[dict, list[dict]]:
    """The answer to `body`, then its stream's events (asking for usage)."""
    url = server().url + path
    whole = httpx.post(url, json=body, timeout=120)
    streamed = httpx.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True}}, timeout=120)
    assert whole.status_code == streamed.status_code == 200, (whole.text, streamed.text)
    return whole.json(), _events(streamed)


def _byte(value: int) -> int:
    """The token of one byte."""
    return _byte_tokens()[value]


@functools.lru_cache(maxsize=1)
def _byte_tokens() -> dict[int, int]:
    token_bytes = server().app.state.prism.token_bytes
    tok = server().engine.inputs.tokenizer
    return {raw[0]: i for i in range(tok.get_vocab_size(with_added_tokens=False)) if len(raw := token_bytes(i)) == 1}


def _whole(prompt: list[int]) -> str:
    """The text of `prompt` (special tokens kept, as echoed) without an incomplete last character: its last U+FFFD is
    one when a continuation byte after it keeps the text as long (it continues that character, it adds none)."""
    tok = server().engine.inputs.tokenizer
    text = tok.decode(prompt, skip_special_tokens=False)
    if text.endswith(FFFD) and any(len(tok.decode([*prompt, _byte(b)], skip_special_tokens=False)) == len(text)
                                  for b in range(0x80, 0xC0)):
        return text[:-1]
    return text


def _expected(tokens: list[int], budget: int, stops: tuple[str, ...], stop_token_ids: tuple[int, ...],
              prompt: list[int]) -> tuple[str, str]:
    """The text and finish reason of `tokens` generated within `budget` after `prompt`: the decode of both up to the
    first stop token (its own text left out), after the prompt's whole characters, cut before the first stop
    string."""
    ended = next((i for i, t in enumerate(tokens[:budget]) if t in stop_token_ids), None)
    both = server().engine.inputs.tokenizer.decode(prompt + (tokens[:budget] if ended is None else tokens[:ended]))
    whole = _whole(prompt)
    assert both.startswith(whole), f"premise: the decode of the prompt and the tokens {both!r} starts with {whole!r}"
    full = both[len(whole) :]
    found = [full.find(s) for s in stops if s in full]
    if found:
        return full[: min(found)], "stop"
    return full, "length" if ended is None else "stop"


def _counts(usage: dict) -> dict:
    """A usage's token counts but its cache hits (the second of two equal prompts hits the cache)."""
    return {key: value for key, value in usage.items() if key != "prompt_tokens_details"}


def _chat(body: dict, n: int) -> tuple[list[str], list[str | None], list[list[dict]], dict]:
    """Each choice's (text, finish reason, logprobs entries) streamed, checked equal to the answer, and the usage."""
    whole, events = _post("/v1/chat/completions", body)
    texts, reasons, logprobs = [""] * n, [None] * n, [[] for _ in range(n)]
    for event in events[:-1]:
        for choice in event["choices"]:
            i = choice["index"]
            texts[i] += choice["delta"].get("content") or ""
            reasons[i] = choice["finish_reason"] or reasons[i]
            logprobs[i] += (choice["logprobs"] or {}).get("content") or []
    assert events[-1]["choices"] == [] and _counts(events[-1]["usage"]) == _counts(whole["usage"]), "usage differs"
    for i, choice in enumerate(whole["choices"]):
        assert (choice["message"]["content"], choice["finish_reason"]) == (texts[i], reasons[i]), (
            f"choice {i} streamed {(texts[i], reasons[i])} but answered {choice['message']['content']!r}")
        assert (choice["logprobs"] or {}).get("content", []) == logprobs[i], f"choice {i}'s logprobs differ streamed"
    return texts, reasons, logprobs, whole["usage"]


def _completion(body: dict, n: int) -> tuple[list[dict], dict]:
    """The answer's choices, each checked equal to its stream's (text, finish reason, logprobs), and its usage."""
    whole, events = _post("/v1/completions", body)
    texts, reasons = [""] * n, [None] * n
    logprobs = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for _ in range(n)]
    for event in events[:-1]:
        for choice in event["choices"]:
            i = choice["index"]
            texts[i] += choice["text"]
            reasons[i] = choice["finish_reason"] or reasons[i]
            for key, values in (choice["logprobs"] or {}).items():
                logprobs[i][key] += values
    assert events[-1]["choices"] == [] and _counts(events[-1]["usage"]) == _counts(whole["usage"]), "usage differs"
    for i, choice in enumerate(whole["choices"]):
        assert (choice["text"], choice["finish_reason"]) == (texts[i], reasons[i]), (
            f"choice {i} streamed {(texts[i], reasons[i])} but answered {(choice['text'], choice['finish_reason'])}")
        if choice["logprobs"] is not None:
            assert choice["logprobs"] == logprobs[i], f"choice {i}'s logprobs differ streamed"
    return whole["choices"], whole["usage"]


def _text_offsets(prompt: list[int], generated: list[int]) -> list[int]:
    """Each generated token's `text_offset` by its definition, from the bytes: the characters of the text (the
    prompt's incomplete last character, then the generated tokens) made wholly of bytes before the token. A character
    before the token's bytes is still incomplete when a continuation byte keeps the text as long; the token's first
    byte ends it unless it keeps the text as long (continuing it)."""
    token_bytes = server().app.state.prism.token_bytes
    specials = {i for i, t in server().engine.inputs.tokenizer.get_added_tokens_decoder().items() if t.special}

    def chars(raw: bytes) -> int:
        return len(raw.decode("utf-8", "replace"))

    def incomplete(raw: bytes) -> bool:
        return any(chars(raw + bytes([b])) == chars(raw) for b in range(0x80, 0xC0)) if raw else False

    prompt_bytes = b"".join(token_bytes(t) for t in prompt)
    whole = _whole(prompt).encode()
    assert prompt_bytes.startswith(whole), "premise: the prompt is whole characters and maybe part of one"
    seen, offsets = prompt_bytes[len(whole) :], []
    for token in generated:
        own = b"" if token in specials else token_bytes(token)
        continued = incomplete(seen) and (not own or chars(seen + own[:1]) == chars(seen))
        offsets.append(chars(seen) - continued)
        seen += own
    return offsets


def _check_legacy_logprobs(logprobs: dict, prompt: list[int], generated: list[int]) -> None:
    tokens, chosen, tops, offsets = (logprobs[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    assert len(tokens) == len(chosen) == len(tops) == len(offsets)
    want = _text_offsets(prompt, generated)
    assert offsets == want, f"text offsets {offsets}, want {want}: tokens {tokens}"
    for token, logprob, top in zip(tokens, chosen, tops, strict=True):
        assert top.get(token) == logprob, (
            f"top_logprobs {top} lists the chosen token {token!r} with another logprob than its own {logprob}")
        assert logprob == max(top.values()), f"greedy chose {token!r} ({logprob}) but top_logprobs has {top}"


@settings(max_examples=25, deadline=None)
@given(script=scripts(), n=st.integers(1, 2), k=st.sampled_from([None, 0, 2, 3]), echo=st.booleans())
def spec_what_a_client_reads_is_the_engines_text(script, n, k, echo) -> None:
    tokens, alternatives, budget, stops, stop_token_ids, prompt = script
    live = server()
    tok = live.engine.inputs.tokenizer
    want, reason = _expected(tokens, budget, stops, stop_token_ids, tok.encode("Hi").ids)
    prompt_ids = tok.encode(prompt).ids if isinstance(prompt, str) else prompt
    legacy_want, legacy_reason = _expected(tokens, budget, stops, stop_token_ids, prompt_ids)
    # The EOS ends the answer when it is asked for as a stop token id: otherwise it is ignored (any text's tokens).
    common = {"model": MODEL, "max_tokens": budget, "stop": list(stops), "n": n, "temperature": 0,
              "ignore_eos": live.engine.inputs.eos_token_ids[0] not in stop_token_ids,
              "stop_token_ids": [t for t in stop_token_ids if t not in live.engine.inputs.eos_token_ids]}
    chat = {"messages": [{"role": "user", "content": "Hi"}]} | ({} if k is None else {"logprobs": True,
                                                                                    "top_logprobs": k})
    echo = echo and k is None  # echo with logprobs is refused
    legacy = {"prompt": prompt, "echo": echo} | ({} if k is None else {"logprobs": k})
    tail = [0] * 4  # a row launched for a request that already stopped samples past its script
    with scripted_tokens(live.engine, lambda request_id: tokens + tail, lambda request_id: alternatives + [{}] * 4):
        texts, reasons, logprobs, usage = _chat(common | chat, n)
        choices, legacy_usage = _completion(common | legacy, n)
    assert (texts, reasons) == ([want] * n, [reason] * n), f"chat answered {texts} {reasons}, want {want!r} {reason}"
    generated = usage["completion_tokens"] // n
    assert usage["completion_tokens"] == n * generated, f"choices generated {usage['completion_tokens']} in all"
    assert generated == budget if reason == "length" else generated <= budget, f"{generated} tokens generated"
    legacy_generated = legacy_usage["completion_tokens"] // n
    assert legacy_usage["completion_tokens"] == n * legacy_generated, "completions' choices generated other counts"
    if prompt == "Hi":
        assert legacy_generated == generated, "chat and completions generated other token counts"
    else:  # its text differs where the prompt's last character is completed: a stop string may end it elsewhere
        assert legacy_generated == budget if legacy_reason == "length" else legacy_generated <= budget
    echoed = _whole(prompt_ids) if echo else ""
    answered = [(c["text"], c["finish_reason"]) for c in choices]
    assert answered == [(echoed + legacy_want, legacy_reason)] * n, (
        f"completions answered {answered}, want {(echoed + legacy_want, legacy_reason)}")
    if k is not None:
        assert [len(lp) for lp in logprobs] == [generated] * n, "not one chat logprobs entry per generated token"
        for choice in choices:
            assert len(choice["logprobs"]["tokens"]) == legacy_generated, "not one logprobs entry per generated token"
            _check_legacy_logprobs(choice["logprobs"], prompt_ids, tokens[:legacy_generated])
