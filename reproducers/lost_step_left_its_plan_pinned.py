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

from prism.engine.config import EngineConfig
from prism.engine.engine import Engine
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint

engine = Engine(ensure_tiny_checkpoint(), EngineConfig(page_size=16, num_gpu_pages=32, check_invariants=True))
one = SamplingParams(max_tokens=1)


def run_to_the_end() -> list:
    events = []
    while engine.has_unfinished_requests():
        events += engine.step()
    return events


engine.add_request("first", "word " * 20, one)  # cached: a full page, and rows of the next
run_to_the_end()
planned = []


def fails_at_its_entry(slices, kv, plan, *args, **kwargs):
    planned.extend(plan.copy_prefix)
    raise RuntimeError("a planted failure at the runner's entry")


engine.runner.execute = fails_at_its_entry
engine.add_request("second", "word " * 20 + "and more", one)  # a hit: the full page shared, the rows copied
(event,) = run_to_the_end()
if event.error is None or not planned:
    raise SystemExit(f"BUG IN THE REPRODUCER: no failed step with a tail copy ({event}, planned {planned})")
held = engine.kv.gpu.num_pages - engine.kv.num_allocatable()
engine.kv.check_invariants()
_common.verdict(held == 0, f"the step failed its request; the tail copy {planned} it planned holds no page after it",
                f"the engine is idle, yet {held} KV pages are held for no request: the tail copy {planned} its lost "
                "step planned is still pinned")
