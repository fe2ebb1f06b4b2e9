"""Spec of a decision's questions before they are forked (`Engine.add_decision`, `abort`, `_finish`): every question
id gets exactly one terminal event, whatever ends its material first.

A decision's questions become engine requests only when their shared material is computed (each is then forked from
it). Invariant: over decisions of 2-3 questions, with, at a drawn step before or after the fork, the material aborted,
one question aborted, or the material's step failing on the device, every question id gets exactly one terminal event
(an aborted or failed material ends its unforked questions with its reason; an aborted question ends alone, and its
material with it when no question is left), the engine ends idle, no id stays taken, and the KV manager holds nothing.
(Session 27's review: questions whose material was aborted by a leaving client, or failed, got no event at all, and
the server kept their in-flight slots for good.)
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prism.decision.plan import Readouts, advance, plan_decision
from prism.decision.questions import Question
from prism.engine.llm import LLM
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.shared_engines import reused_while_clean

MATERIAL = [{"role": "user", "content": "Read this note carefully: the lamp is on and the door is shut, twice over."}]


@reused_while_clean
def engine_under_test() -> LLM:
    """Shared by the examples while it holds nothing of the last one: a failed example's requests would run beside
    the next one's (their decide named d<serial> again while Hypothesis shrinks: its ids refused as in use)."""
    # Small steps: the material takes several, so an ending can fall before the fork.
    return LLM(ensure_tiny_checkpoint(), dtype="float32", page_size=4, num_gpu_pages=64, max_num_batched_tokens=16,
               check_invariants=True)


@settings(max_examples=30, deadline=None)
@given(questions=st.integers(2, 3), ending=st.sampled_from(["abort material", "abort question", "material fails"]),
       at_step=st.integers(0, 6), which=st.integers(0, 2), serial=st.integers(0, 10**9))
def spec_every_question_ends_once(questions, ending, at_step, which, serial) -> None:
    engine = engine_under_test().engine
    qs = [Question("yes_no", f"Question {i}: is the lamp bright?") for i in range(questions)]
    state, work = advance(plan_decision(f"d{serial}", MATERIAL, qs, engine.inputs), None)
    assert state == "work" and isinstance(work, Readouts) and work.decision_id is not None
    ids = engine.add_decision(work.decision_id, work.branches)
    material = f"{work.decision_id}/material"
    execute = engine.runner.execute
    finals: dict[str, int] = {}
    try:
        for step in range(200):
            if step == at_step:
                if ending == "abort material":
                    engine.abort(material)
                elif ending == "abort question":
                    engine.abort(ids[which % len(ids)])
                else:
                    def fail_once(*args, **kwargs):
                        engine.runner.execute = execute
                        raise RuntimeError("planted device failure")
                    engine.runner.execute = fail_once
            for event in engine.step():
                if event.finished:
                    finals[event.request_id] = finals.get(event.request_id, 0) + 1
            if not engine.has_unfinished_requests() and step >= at_step:
                break
    finally:
        engine.runner.execute = execute
    assert all(finals.get(i) == 1 for i in ids), f"{ending} at step {at_step}: terminal events {finals} for {ids}"
    assert not engine.has_unfinished_requests() and not engine.requests and not engine._unspawned
    assert not engine.kv.seqs, "a sequence was left in the KV manager"
