"""A step interrupted by what is not an `Exception` (Ctrl-C while `LLM.generate` or a stream is read: they let it
through and stay usable) still settles its transfer plan: the interrupt reaches the caller, the plan's moves run
(a tail copy here) and its pages are unpinned, so the idle engine holds nothing for no request."""

from __future__ import annotations

import pytest

from prism.engine import lost_steps
from prism.engine.config import EngineConfig
from prism.engine.engine import Engine
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint

ONE = SamplingParams(max_tokens=1)


def _interrupted_with_a_tail_copy() -> tuple[Engine, list]:
    engine = Engine(ensure_tiny_checkpoint(), EngineConfig(page_size=16, num_gpu_pages=32, check_invariants=True))
    engine.add_request("first", "word " * 20, ONE)  # cached: a full page, and rows of the next
    while engine.has_unfinished_requests():
        engine.step()
    planned = []
    real = engine.runner.execute

    def interrupted(slices, kv, plan, *args, **kwargs):
        planned.extend(plan.copy_prefix)
        raise KeyboardInterrupt

    engine.runner.execute = interrupted
    engine.add_request("second", "word " * 20 + "and more", ONE)  # a hit: the full page shared, the rows copied
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.runner.execute = real
    assert planned, "the scenario must plan a tail copy"
    engine.abort("second")
    engine.step()
    return engine, planned


def test_an_interrupted_step_settles_its_plan():
    engine, planned = _interrupted_with_a_tail_copy()
    held = engine.kv.gpu.num_pages - engine.kv.num_allocatable()
    engine.kv.check_invariants()
    assert held == 0, f"{held} pages held after the interrupted step's tail copy {planned}"


def test_the_check_fails_when_an_interrupt_skips_the_plan(monkeypatch):
    """Planted: the interrupt goes through without the plan settled (the split's first version)."""
    monkeypatch.setattr(lost_steps, "settle_after_an_interrupt", lambda engine, plan: None)
    engine, planned = _interrupted_with_a_tail_copy()
    held = engine.kv.gpu.num_pages - engine.kv.num_allocatable()
    assert held > 0, "with the plan never settled its pages stay pinned: the check above must see them"
