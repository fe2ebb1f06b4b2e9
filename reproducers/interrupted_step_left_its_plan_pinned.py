"""Found by a review of session 31's engine split: once the engine took every step's transfer plan itself, a step
interrupted by what is not an `Exception` (Ctrl-C while `LLM.generate` or a stream is read; both let it through and
stay usable) left its plan taken and never settled: its pages pinned for good, and, had the interrupt come before
the moves, the manager counting swaps done that never ran. Before the split the runner's `finally` finished it. Fixed:
`lost_steps.settle_after_an_interrupt`, then the interrupt goes on.

Here a prompt hits the cache with a tail copy, and its step is interrupted at the runner's entry."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable

from prism.engine.config import EngineConfig
from prism.engine.engine import Engine
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint

engine = Engine(ensure_tiny_checkpoint(), EngineConfig(page_size=16, num_gpu_pages=32, check_invariants=True))
one = SamplingParams(max_tokens=1)
engine.add_request("first", "word " * 20, one)  # cached: a full page, and rows of the next
while engine.has_unfinished_requests():
    engine.step()
planned = []
execute = engine.runner.execute


def interrupted_at_its_entry(slices, kv, plan, *args, **kwargs):
    planned.extend(plan.copy_prefix)
    raise KeyboardInterrupt


engine.runner.execute = interrupted_at_its_entry
engine.add_request("second", "word " * 20 + "and more", one)  # a hit: the full page shared, the rows copied
try:
    engine.step()
    raise SystemExit("BUG IN THE REPRODUCER: the step was not interrupted")
except KeyboardInterrupt:
    pass
engine.runner.execute = execute
if not planned:
    raise SystemExit("BUG IN THE REPRODUCER: the interrupted step planned no tail copy")
engine.abort("second")
engine.step()
held = engine.kv.gpu.num_pages - engine.kv.num_allocatable()
engine.kv.check_invariants()
_common.verdict(held == 0, f"the interrupt went through; the tail copy {planned} its step planned holds no page after it",
                f"the engine is idle, yet {held} KV pages are held: the interrupted step's tail copy {planned} is still "
                "pinned")
