"""Found by `specs/spec_server_nothing_lost.py` (session 30): a step lost before the runner took its transfer plan
from the KV manager (`ModelRunner.execute` failing at its entry: its own checks, or the lost step planted by the
server specs) failed its requests but left the plan with the manager, its pages pinned. Nothing ran it until the next
step, so a server that then went idle held those pages for no request (`kv_cache_usage_perc` above 0 on an idle
server, here a tail copy's two pages). Fixed when the engine ran a plan its lost step left as the runner ran a lost
step's; now the engine takes every step's plan before it calls the runner, and one function runs what of a lost step's
plan did not run and unpins it (`lost_steps.fail_a_lost_step`).

Here a prompt hits the cache with a tail copy, and the step that would compute it fails at the runner's entry."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable

from prism.testing import tail_copy_step as scenario

engine = scenario.engine_with_a_cached_prompt()
planned = scenario.raise_at_the_runners_entry(engine, RuntimeError("a planted failure at the runner's entry"))
engine.add_request("second", scenario.HITTING_PROMPT, scenario.ONE_TOKEN)
events = []
while engine.has_unfinished_requests():
    events += engine.step()
(event,) = events
if event.error is None or not planned:
    raise SystemExit(f"BUG IN THE REPRODUCER: no failed step with a tail copy ({event}, planned {planned})")
held = scenario.pages_held(engine)
engine.kv.check_invariants()
_common.verdict(held == 0, f"the step failed its request; the tail copy {planned} it planned holds no page after it",
                f"the engine is idle, yet {held} KV pages are held for no request: the tail copy {planned} its lost "
                "step planned is still pinned")
