"""Found by a review of session 31's engine split: once the engine took every step's transfer plan itself, a step
interrupted by what is not an `Exception` (Ctrl-C while `LLM.generate` or a stream is read; both let it through and
stay usable) left its plan taken and never settled: its pages pinned for good, and, had the interrupt come before
the moves, the manager counting swaps done that never ran. Before the split the runner's `finally` finished it. Fixed:
`lost_steps.settle_after_an_interrupt`, then the interrupt goes on.

Here a prompt hits the cache with a tail copy, and its step is interrupted at the runner's entry."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable

from prism.testing import tail_copy_step as scenario

engine = scenario.engine_with_a_cached_prompt()
execute = engine.runner.execute
planned = scenario.raise_at_the_runners_entry(engine, KeyboardInterrupt())
engine.add_request("second", scenario.HITTING_PROMPT, scenario.ONE_TOKEN)
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
held = scenario.pages_held(engine)
engine.kv.check_invariants()
_common.verdict(held == 0, f"the interrupt went through; the tail copy {planned} its step planned holds no page after it",
                f"the engine is idle, yet {held} KV pages are held: the interrupted step's tail copy {planned} is still "
                "pinned")
