"""A step whose transfer plan holds a tail copy, failed or interrupted at the runner's entry: the scenario of the
checks that a lost or interrupted step still settles its plan (`tests/test_interrupted_step.py`, the
`*_left_its_plan_pinned.py` reproducers). Owns no invariant."""

from __future__ import annotations

from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.sampling import SamplingParams
from .checkpoints import ensure_tiny_checkpoint

ONE_TOKEN = SamplingParams(max_tokens=1)
CACHED_PROMPT = "word " * 20  # cached: a full page, and rows of the next
HITTING_PROMPT = CACHED_PROMPT + "and more"  # a hit: the full page shared, the rows copied (the tail copy)


def engine_with_a_cached_prompt() -> Engine:
    """The tiny checkpoint's engine (page size 16, invariants checked) once CACHED_PROMPT has run."""
    engine = Engine(ensure_tiny_checkpoint(), EngineConfig(page_size=16, num_gpu_pages=32, check_invariants=True))
    engine.add_request("first", CACHED_PROMPT, ONE_TOKEN)
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def raise_at_the_runners_entry(engine: Engine, error: BaseException) -> list:
    """From now on the engine's runner raises `error` at its entry; the list it returns receives each failed step's
    planned tail copies."""
    planned = []

    def raising(slices, kv, plan, *args, **kwargs):
        planned.extend(plan.copy_prefix)
        raise error

    engine.runner.execute = raising
    return planned


def pages_held(engine: Engine) -> int:
    """KV pages that are not allocatable: on an idle engine, held for no request."""
    return engine.kv.gpu.num_pages - engine.kv.num_allocatable()
