"""Spec of what a client reads of a generation: the engine's text, tokens and logprobs rendered as OpenAI's chat and
legacy completions, streamed or not, on the real server (tiny checkpoint, CPU), its tokens scripted
(`prism.testing.scripted_tokens`) so that the text holds multi-byte characters split over byte tokens, and so that
each token has likely alternatives, often byte tokens of the same text (U+FFFD).

Invariant: for each choice, with `full` the decode of the tokens the script gives it up to its budget or up to its
first stop token (an EOS not ignored, a stop token id), that token's own text left out:
- its text streamed (the concatenation of its deltas) is its text not streamed, which is `full` cut before its first
  stop string, after the echoed prompt under `echo`; its finish reason is "stop" exactly when `full` holds a stop
  string or a stop token ended it, and the same streamed or not;
- its logprobs have one entry per generated token, the same streamed or not; in the legacy layout `text_offset`
  starts after the echo and never decreases, and `top_logprobs[i]` lists the chosen token's text with its own logprob
  (`token_logprobs[i]`) and any other text with its most likely token's (greedy: the chosen's is the highest);
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


@functools.lru_cache(maxsize=1)
def server():
    return serve_in_thread(ServerSettings())  # a daemon thread: it ends with the process


@st.composite
def scripts(draw: st.DrawFn) -> tuple[list[int], list[dict[int, float]], int, tuple[str, ...], tuple[int, ...]]:
    """(the scripted tokens, each one's alternatives by logit, the budget, the stop strings, the stop token ids): the
    tokens of a drawn text, one maybe dropped (a byte that cuts a character), maybe an EOS put in (or one of its
    tokens made a stop token id); alternatives mostly bytes above 0x7f (one of a split character reads U+FFFD, as the
    scripted token often does); stop strings mostly from the budget's text."""
    inputs = server().engine.inputs
    tok = inputs.tokenizer
    tokens = tok.encode(draw(st.lists(CHARACTERS, min_size=1, max_size=8).map("".join))).ids
    if len(tokens) > 1 and draw(st.booleans()):
        del tokens[draw(st.integers(0, len(tokens) - 1))]
    ends = draw(st.sampled_from(["budget", "budget", "eos", "stop token id"]))
    stop_token_ids = ()
    if ends != "budget":
        stop_token_ids = (inputs.eos_token_ids[0] if ends == "eos" else draw(st.sampled_from(tokens)),)
        if draw(st.booleans()):
            tokens.insert(draw(st.integers(0, len(tokens))), stop_token_ids[0])
    # Byte-level BPE names the bytes 0xa1-0xff but 0xad by their own characters: lead and continuation bytes.
    high_bytes = [tok.token_to_id(chr(b)) for b in range(0xA1, 0x100) if b != 0xAD]
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
    return tokens, alternatives, budget, tuple(stops), stop_token_ids


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


def _expected(tokens: list[int], budget: int, stops: tuple[str, ...], stop_token_ids: tuple[int, ...]
              ) -> tuple[str, str]:
    """The text and finish reason of `tokens` generated within `budget`: up to the first stop token (its own text
    left out), cut before the first stop string."""
    ended = next((i for i, t in enumerate(tokens[:budget]) if t in stop_token_ids), None)
    full = server().engine.inputs.tokenizer.decode(tokens[:budget] if ended is None else tokens[:ended])
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


def _check_legacy_logprobs(logprobs: dict, echo: str) -> None:
    tokens, chosen, tops, offsets = (logprobs[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    assert len(tokens) == len(chosen) == len(tops) == len(offsets)
    assert offsets == sorted(offsets) and all(o >= len(echo) for o in offsets), f"text offsets {offsets}"
    for token, logprob, top in zip(tokens, chosen, tops, strict=True):
        assert top.get(token) == logprob, (
            f"top_logprobs {top} lists the chosen token {token!r} with another logprob than its own {logprob}")
        assert logprob == max(top.values()), f"greedy chose {token!r} ({logprob}) but top_logprobs has {top}"


@settings(max_examples=25, deadline=None)
@given(script=scripts(), n=st.integers(1, 2), k=st.sampled_from([None, 0, 2, 3]), echo=st.booleans())
def spec_what_a_client_reads_is_the_engines_text(script, n, k, echo) -> None:
    tokens, alternatives, budget, stops, stop_token_ids = script
    live = server()
    want, reason = _expected(tokens, budget, stops, stop_token_ids)
    # The EOS ends the answer when it is asked for as a stop token id: otherwise it is ignored (any text's tokens).
    common = {"model": MODEL, "max_tokens": budget, "stop": list(stops), "n": n, "temperature": 0,
              "ignore_eos": live.engine.inputs.eos_token_ids[0] not in stop_token_ids,
              "stop_token_ids": [t for t in stop_token_ids if t not in live.engine.inputs.eos_token_ids]}
    chat = {"messages": [{"role": "user", "content": "Hi"}]} | ({} if k is None else {"logprobs": True,
                                                                                    "top_logprobs": k})
    echo = echo and k is None  # echo with logprobs is refused
    legacy = {"prompt": "Hi", "echo": echo} | ({} if k is None else {"logprobs": k})
    tail = [0] * 4  # a row launched for a request that already stopped samples past its script
    with scripted_tokens(live.engine, lambda request_id: tokens + tail, lambda request_id: alternatives + [{}] * 4):
        texts, reasons, logprobs, usage = _chat(common | chat, n)
        choices, legacy_usage = _completion(common | legacy, n)
    assert (texts, reasons) == ([want] * n, [reason] * n), f"chat answered {texts} {reasons}, want {want!r} {reason}"
    generated = usage["completion_tokens"] // n
    assert usage["completion_tokens"] == n * generated, f"choices generated {usage['completion_tokens']} in all"
    assert generated == budget if reason == "length" else generated <= budget, f"{generated} tokens generated"
    assert legacy_usage["completion_tokens"] == n * generated, "chat and completions generated other token counts"
    echoed = "Hi" if echo else ""
    assert [(c["text"], c["finish_reason"]) for c in choices] == [(echoed + want, reason)] * n, (
        f"completions answered {[(c['text'], c['finish_reason']) for c in choices]}, want {(echoed + want, reason)}")
    if k is not None:
        assert [len(lp) for lp in logprobs] == [generated] * n, "not one chat logprobs entry per generated token"
        for choice in choices:
            assert len(choice["logprobs"]["tokens"]) == generated, "not one logprobs entry per generated token"
            _check_legacy_logprobs(choice["logprobs"], echoed)
