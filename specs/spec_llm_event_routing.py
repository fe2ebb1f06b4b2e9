"""Spec of the offline API's event routing (`prism.engine.llm`): calls that share one engine each receive all of
their own requests' events, in order, and none of another's.

Invariant: whatever the interleaving of calls on one `LLM` (streams opened, read a few events at a time in any
order, closed early or dropped; `generate` batches run in between), every stream read to its end yields exactly the
tokens its request gets run alone (greedy), ending with one terminal event, and every `generate` returns each
prompt's tokens; afterwards the engine holds no request and no KV sequence. The engine's `step` returns every
request's events: a call that kept only its own lost the others' (session 27's review: a stream whose remaining
events a `generate` had taken spun for ever; two streams read in turn each lost tokens).
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.shared_engines import reused_while_clean

PROMPTS = ["Tell me a story.", "Hi", "Count to ten:", "What is red?", "One more."]


@reused_while_clean
def engine_under_test() -> LLM:
    """Shared by the examples while it holds nothing of the last one: the streams a failed example left open (its
    traceback holds them) would run beside the next one's, and a request left for good would fail its check that
    nothing is left behind."""
    return LLM(ensure_tiny_checkpoint(), dtype="float32", num_gpu_pages=256, check_invariants=True)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


_ALONE: dict[tuple[str, int], tuple[int, ...]] = {}


def alone(llm: LLM, prompt: str, max_tokens: int) -> tuple[int, ...]:
    """The greedy tokens of `prompt` (asked on `llm` the first time, whatever else it runs then)."""
    if (prompt, max_tokens) not in _ALONE:
        (out,) = llm.generate([prompt], params(max_tokens))
        _ALONE[prompt, max_tokens] = tuple(out.token_ids)
    return _ALONE[prompt, max_tokens]


@st.composite
def operations(draw: st.DrawFn) -> list[tuple]:
    """Streams opened first, then mostly reads of a few events from any of them, with generates, closes and more
    streams in between (reads in turn across streams are what lost events)."""
    ops: list[tuple] = [("open", draw(st.sampled_from(PROMPTS)), draw(st.integers(1, 5)))
                        for _ in range(draw(st.integers(1, 3)))]
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["read"] * 4 + ["generate", "close", "open"]))
        if kind == "open":
            ops.append(("open", draw(st.sampled_from(PROMPTS)), draw(st.integers(1, 5))))
        elif kind == "read":
            ops.append(("read", draw(st.integers(0, 9)), draw(st.integers(1, 3))))
        elif kind == "close":
            ops.append(("close", draw(st.integers(0, 9))))
        else:
            ops.append(("generate", draw(st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=3)),
                        draw(st.integers(1, 4))))
    return ops


MAX_STEPS = 400  # far more than any example's requests need: past it, a call is waiting for events it lost


@settings(max_examples=25, deadline=None)
@given(ops=operations())
def spec_each_call_gets_all_of_its_own_events(ops) -> None:
    llm = engine_under_test()
    engine, step = llm.engine, type(llm.engine).step
    steps = 0

    def bounded_step(self=engine):
        nonlocal steps
        steps += 1
        assert steps <= MAX_STEPS, "a call kept stepping the engine for events it will never get (lost to another)"
        return step(self)

    engine.step = bounded_step
    try:
        run_operations(llm, ops)
    finally:
        del engine.step
    while llm.engine.has_unfinished_requests():  # the closed streams' terminal events
        llm.engine.step()
    assert not llm.engine.requests and not llm.engine.kv.seqs, "requests or KV sequences were left behind"


def run_operations(llm: LLM, ops: list[tuple]) -> None:
    streams: list[list] = []  # (stream, prompt, max_tokens, tokens read, events read, finished, closed)
    for op in ops:
        if op[0] == "open":
            streams.append([llm.stream(op[1], params(op[2])), op[1], op[2], [], 0, False, False])
        elif op[0] == "generate":
            outs = llm.generate(op[1], params(op[2]))
            for prompt, out in zip(op[1], outs, strict=True):
                assert tuple(out.token_ids) == alone(llm, prompt, op[2]), "a generate beside open streams lost tokens"
        elif streams:
            s = streams[op[1] % len(streams)]
            if op[0] == "close":
                s[0].close()
                s[6] = True
            else:
                for event in itertools.islice(s[0], op[2]):
                    s[3] += event.new_token_ids
                    s[4] += 1
                    s[5] = event.finished
    for s in streams:  # read every open stream to its end
        if not s[6]:
            for event in s[0]:
                s[3] += event.new_token_ids
                s[4] += 1
                assert s[4] <= s[2] + 1, "a stream yielded more events than its request has tokens"
                s[5] = event.finished
            assert s[5], "a stream ended without its terminal event"
            want = alone(llm, s[1], s[2])
            assert tuple(s[3]) == want, f"a stream of {s[1]!r} read {s[3]}, alone {want}"

