"""Spec: a decide's usage is every engine request it made (`decision/plan.py`'s usage half).

Against the real engine on the tiny checkpoint: decides of one to three questions (plain ones and a choice of 30
options, asked in two groups and a final round), with or without gated thinking (a gate that lets none, some or all
think), cold or after a decide that left their material in the prefix cache. Each answer's usage (prompt tokens, of
them from the prefix cache, generated tokens) is the sum over the engine's own terminal events of every request made
for its question: each readout, group and final round, a reasoning generation (its prompt and its tokens) and its
re-read. A decision's material is no question's request: its tokens are in each question's prompt. The server's
`usage` is the sum of its answers' (`serving/decide_protocol.py`).

Historical (session 33's review): a grouped choice counted only its final round's prompt, a thinking question only its
first readout's.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from prism.decision.questions import Question
from prism.decision.thinking import ThinkingConfig
from prism.engine.llm import LLM
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.shared_engines import reused_while_clean

MATERIAL = [{"role": "user", "content": "Read this note carefully: the lamp is on and the door is shut."}]
POOL = (Question("yes_no", "Is the lamp on?"), Question("score", "How bright is it?", levels=(1, 2, 3)),
        Question("choice", "Which is shut?", ("the lamp", "the door", "nothing")),
        Question("choice", "Which word fits?", tuple(f"word {k}" for k in range(30))))
QUESTION_ID = re.compile(r"/q(\d+)")  # a question's engine requests: <decide>/q<i>, /q<i>g<g>, /q<i>final, /q<i>/...
USAGE = ("prompt_tokens", "cached_tokens", "completion_tokens")


@contextlib.contextmanager
def engine_usage(llm: LLM) -> Iterator[dict[int | None, dict[str, int]]]:
    """Wraps `llm.engine.step` while open: the usage of the requests the engine ends meanwhile, by the question index
    in their id (None: not a question's), by their own events; a decision's material (`.../material`) is counted
    nowhere."""
    usage: dict[int | None, dict[str, int]] = defaultdict(lambda: dict.fromkeys(USAGE, 0))
    step = llm.engine.step

    def counted_step():
        events = step()
        for event in events:
            if event.request_id.endswith("/material"):
                continue
            question = QUESTION_ID.search(event.request_id)
            counts = usage[int(question.group(1)) if question else None]
            counts["completion_tokens"] += len(event.new_token_ids)
            if event.finished:
                counts["prompt_tokens"] += event.prompt_tokens
                counts["cached_tokens"] += event.cached_tokens
        return events

    llm.engine.step = counted_step
    try:
        yield usage
    finally:
        del llm.engine.step


@reused_while_clean
def engine_under_test() -> LLM:
    """Shared by the examples while it holds nothing of the last one: the terminal events of a failed example's
    requests (aborted as its decide failed) would come out of the next one's first step, counted as its questions'."""
    return LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=4, num_gpu_pages=256, check_invariants=True)


@settings(max_examples=15, deadline=None)
@given(picks=st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=3),
       gate=st.none() | st.sampled_from([0.0, 0.6, 1.0]), warm=st.booleans(), seed=st.integers(0, 3))
def spec_each_answer_counts_every_request_of_its_question(picks, gate, warm, seed) -> None:
    llm = engine_under_test()
    if not warm:
        llm.engine.kv.clear_cache()
    thinking = None if gate is None else ThinkingConfig(gate=gate, max_tokens=4, seed=seed)
    with engine_usage(llm) as usage:
        answers = llm.decide(MATERIAL, [POOL[p] for p in picks], thinking)
    assert set(usage) <= set(range(len(picks))), f"requests of no question: {usage.get(None)}"
    for i, answer in enumerate(answers):
        reported = {key: getattr(answer, key) for key in USAGE}
        assert reported == usage[i], (f"question {i} ({POOL[picks[i]].text!r}, thought: {answer.thought}) reports "
                                      f"{reported}; its engine requests used {usage[i]}")
        assert answer.completion_tokens == answer.thinking_tokens
    assert not llm.engine.requests and not llm.engine.kv.seqs, "a decide left requests or sequences behind"
