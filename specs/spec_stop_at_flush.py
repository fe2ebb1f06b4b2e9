"""Spec of stop strings on the real engine (tiny checkpoint, CPU), its tokens scripted (`prism.testing.scripted_tokens`)
so that the text holds the characters under test: multi-byte ones, split by the budget or by a dropped byte token.

Invariant: a request ends on a stop string the same way wherever the string completes, mid-stream or in the stream's
last flush when the token budget ends it (an incomplete character flushed as U+FFFD, or the stop string's last
characters held back with it). With `full` the decode of the tokens it generated: the streamed text is `full` cut
before its first stop string, and the finish reason is "stop" exactly when `full` holds one ("length" otherwise,
after the whole budget). A stop string completed by the flush ended the request with "length" (the text was cut).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prism.engine.llm import LLM
from prism.engine.request import FinishReason
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.scripted_tokens import scripted_tokens
from prism.testing.shared_engines import reused_while_clean

# Characters of one to four UTF-8 bytes, which byte-level BPE splits across tokens.
CHARACTERS = st.sampled_from(list("ab k.") + ["é", "你", "好", "쀍", "€", "😀", "𝔘"])


@reused_while_clean
def engine_under_test() -> LLM:
    """Shared by the examples while it holds nothing of the last one: a request a failed example left would fail the
    next one's check that nothing is left behind."""
    return LLM(ensure_tiny_checkpoint(), dtype="float32", num_gpu_pages=64, check_invariants=True)


@st.composite
def scripts(draw: st.DrawFn) -> tuple[list[int], int, tuple[str, ...]]:
    """(the tokens generated, the budget, the stop strings): the tokens of a drawn text, one maybe dropped (a byte
    that cuts a character mid-text); stop strings mostly taken from the budget's own text, often its end (which
    the last flush completes when the budget cuts a character), or U+FFFD alone."""
    tok = engine_under_test().engine.inputs.tokenizer
    tokens = tok.encode(draw(st.lists(CHARACTERS, min_size=1, max_size=10).map("".join))).ids
    if len(tokens) > 1 and draw(st.booleans()):
        del tokens[draw(st.integers(0, len(tokens) - 1))]
    budget = draw(st.integers(1, len(tokens)))
    text = tok.decode(tokens[:budget])
    stops = []
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["end", "end", "inside", "replacement", "absent"]))
        if kind in ("end", "inside"):
            start = draw(st.integers(0, len(text) - 1))
            end = len(text) if kind == "end" else draw(st.integers(start + 1, len(text)))
            stops.append(text[start:end])
        else:
            stops.append("\ufffd" if kind == "replacement" else "zzz")
    return tokens, budget, tuple(stops)


@settings(max_examples=80, deadline=None)
@given(script=scripts())
def spec_a_stop_string_ends_the_request_wherever_it_completes(script) -> None:
    tokens, budget, stops = script
    llm = engine_under_test()
    params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True, stop=stops)
    with scripted_tokens(llm.engine, lambda request_id: tokens):
        events = list(llm.stream("Hi", params))
    generated = [t for e in events for t in e.new_token_ids]
    assert generated == tokens[: len(generated)] and len(generated) <= budget, "not the scripted tokens"
    full = llm.engine.inputs.tokenizer.decode(generated)
    found = [full.find(s) for s in stops if s in full]
    text, reason = "".join(e.new_text for e in events), events[-1].finish_reason
    want = full[: min(found)] if found else full
    assert text == want, f"streamed {text!r}, want {want!r}: the text {full!r} cut before the first of {stops}"
    if found:
        assert reason is FinishReason.STOP, f"ended with {reason} though its text {full!r} holds a stop of {stops}"
    else:
        assert (reason, len(generated)) == (FinishReason.LENGTH, budget), f"ended with {reason} without a stop"
    assert not llm.engine.requests and not llm.engine.kv.seqs, "the request or its KV was left behind"
