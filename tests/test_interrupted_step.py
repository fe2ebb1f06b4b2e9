"""A step interrupted by what is not an `Exception` (Ctrl-C while `LLM.generate` or a stream is read: they let it
through and stay usable) still settles its transfer plan: the interrupt reaches the caller, the plan's moves run
(a tail copy here) and its pages are unpinned, so the idle engine holds nothing for no request."""

from __future__ import annotations

import pytest

from prism.engine import lost_steps
from prism.engine.engine import Engine
from prism.testing.tail_copy_step import (
    HITTING_PROMPT,
    ONE_TOKEN,
    engine_with_a_cached_prompt,
    pages_held,
    raise_at_the_runners_entry,
)


def _interrupted_with_a_tail_copy() -> tuple[Engine, list]:
    engine = engine_with_a_cached_prompt()
    execute = engine.runner.execute
    planned = raise_at_the_runners_entry(engine, KeyboardInterrupt())
    engine.add_request("second", HITTING_PROMPT, ONE_TOKEN)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.runner.execute = execute
    assert planned, "the scenario must plan a tail copy"
    engine.abort("second")
    engine.step()
    return engine, planned


def test_an_interrupted_step_settles_its_plan():
    engine, planned = _interrupted_with_a_tail_copy()
    held = pages_held(engine)
    engine.kv.check_invariants()
    assert held == 0, f"{held} pages held after the interrupted step's tail copy {planned}"


def test_the_check_fails_when_an_interrupt_skips_the_plan(monkeypatch):
    """Planted: the interrupt goes through without the plan settled (the split's first version)."""
    monkeypatch.setattr(lost_steps, "settle_after_an_interrupt", lambda engine, plan: None)
    engine, planned = _interrupted_with_a_tail_copy()
    held = pages_held(engine)
    assert held > 0, "with the plan never settled its pages stay pinned: the check above must see them"
