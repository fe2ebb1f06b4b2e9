"""Spec: in deterministic mode a thinking question's answer is its own (gated thinking's half of invariant 7).

Against the real engine on the tiny checkpoint with `deterministic: true`: decides of one to three questions with
gated thinking, in any order, cold or after a decide that left their material in the prefix cache, the gate drawn
among 0, 1 and a question's own first confidence (where the strict `<` decides whether it thinks). Each question's
answer (its probabilities, whether it thought, how many tokens it reasoned) is bitwise the answer of the same question
asked alone on a cold cache. The reasoning's seed is the question's own (`thinking.question_seed`); the logits it
samples from and the first readout the gate reads are bitwise independent of the batch only in this mode.

Outside deterministic mode this is not promised (`decision/thinking.py`): the logits round differently with the
batch companions and the cache hits, so a confidence at the gate thinks or not with its companions
(`reproducers/thinking_gate_follows_the_companions.py`). Until session 33's review the thinking module claimed the
independence in every mode.
"""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from prism.decision.questions import Question
from prism.decision.thinking import ThinkingConfig
from prism.engine.llm import LLM
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.shared_engines import reused_while_clean

MATERIAL = [{"role": "user", "content": "Read this note carefully: the lamp is on and the door is shut."}]
POOL = (Question("yes_no", "Is the lamp on?"), Question("score", "How bright is it?", levels=(1, 2, 3)),
        Question("choice", "Which is shut?", ("the lamp", "the door", "nothing")))
MAX_TOKENS = 4


@reused_while_clean
def engine_under_test() -> LLM:
    """Shared by the examples while it holds nothing of the last one: what a decide that failed for leaving requests
    or sequences behind left would fail the next one's check the same way."""
    return LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=4, num_gpu_pages=256, deterministic=True,
               check_invariants=True)


def answer_of(answer) -> tuple:
    return answer.probabilities, answer.thought, answer.thinking_tokens


@functools.cache
def first_confidence(index: int) -> float:
    (answer,) = engine_under_test().decide(MATERIAL, [POOL[index]])
    return answer.confidence


@functools.cache
def alone(index: int, config: ThinkingConfig) -> tuple:
    llm = engine_under_test()
    llm.engine.kv.clear_cache()
    (answer,) = llm.decide(MATERIAL, [POOL[index]], config)
    return answer_of(answer)


@settings(max_examples=12, deadline=None)
@given(picks=st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=3, unique=True).flatmap(st.permutations),
       gate=st.one_of(st.sampled_from([0.0, 1.0]), st.integers(0, len(POOL) - 1)), warm=st.booleans(),
       seed=st.integers(0, 3))
def spec_a_thinking_answer_is_the_questions_own(picks, gate, warm, seed) -> None:
    llm = engine_under_test()
    config = ThinkingConfig(gate=first_confidence(gate) if isinstance(gate, int) else gate, max_tokens=MAX_TOKENS,
                            seed=seed)
    expected = [alone(i, config) for i in picks]
    if warm:
        llm.decide(MATERIAL, [POOL[(picks[0] + 1) % len(POOL)]])  # its material stays in the prefix cache
    else:
        llm.engine.kv.clear_cache()
    got = [answer_of(a) for a in llm.decide(MATERIAL, [POOL[i] for i in picks], config)]
    for i, mine, theirs in zip(picks, got, expected, strict=True):
        assert mine == theirs, (f"question {i} ({'warm' if warm else 'cold'}, with {picks}, gate {config.gate!r}) "
                                f"answered {mine} where alone it answers {theirs}")
    assert not llm.engine.requests and not llm.engine.kv.seqs, "a decide left requests or sequences behind"
