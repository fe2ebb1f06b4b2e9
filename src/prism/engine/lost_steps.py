"""A lost step: a model step that failed, wherever (at the runner's entry, or while it was built, published or run)
and on whichever path (the scheduled step, or one launched ahead of the host: `async_steps`).

Owns *a failed step loses only its own requests* (invariant 5's executor half) and, for its transfer plan, *nothing
is lost*. The engine takes each step's plan from the KV manager before it calls the runner and hands it in (a plan is
never left with the manager), and `fail_a_lost_step` is the one place a lost step is handled:
- what of the plan its step did not run runs now (`TransferPlan.stages_run`: a step may fail partway through its plan,
  and the stages after the one that raised have not run): the manager counts the moves as done, and
  a request the plan swapped out is not one of the step's, so it is not failed with it and would resume from CPU pages
  that never received its KV (`specs/spec_failed_steps.py`);
- if those moves fail again (a failure that repeats, as an out-of-memory or a bad index would), the live requests
  whose pages they write fail too: their KV is not where the manager says it is, and resumed they would read
  pages that never received it;
- the plan's pages are unpinned: left pinned, they were held for no request, for good on a server gone idle
  (`specs/spec_server_nothing_lost.py`, `reproducers/lost_step_left_its_plan_pinned.py`);
- the step's requests fail, all of them, even if running the plan failed; a step launched ahead of the one in flight
  lets that one commit first (its tokens were sampled: they stream).
Under tensor parallelism a lost step may leave the ranks apart (a follower inside the collectives of a step rank 0
gave up): every rank stops and `TensorParallelFailure` is raised instead. The plan is then only unpinned: run on rank
0 alone, which the followers never did, it would set the ranks' KV apart.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..kv.transfers import EXECUTION_ORDER, TransferPlan
from .inflight import InflightStep
from .tp_workers import Followers, TensorParallelFailure

if TYPE_CHECKING:
    from .engine import Engine
    from .request import Request

log = logging.getLogger(__name__)


def fail_a_lost_step(engine: Engine, plan: TransferPlan, requests: list[Request], error: Exception,
                     in_flight: tuple[InflightStep, set[str]] | None = None) -> None:
    """The step that ran `plan` (taken from the KV manager for it) failed with `error`: under TP settle the plan and
    stop every rank (raises); else commit `in_flight` (the step in flight and its requests whose next row the lost
    step held), settle the plan and fail `requests`."""
    if engine._followers is not None:
        try:
            settle_the_plan(engine, plan)
        finally:
            stop_every_rank(engine._followers, error)
    log.exception("step failed; failing its requests %s", [r.request_id for r in requests])
    try:
        if in_flight is not None:
            engine._accept_tokens(*in_flight)
    finally:
        try:
            settle_the_plan(engine, plan)
        finally:
            engine._fail(requests, error)


def settle_after_an_interrupt(engine: Engine, plan: TransferPlan) -> None:
    """A step interrupted by what is not an `Exception` (KeyboardInterrupt, SystemExit: `LLM.generate` lets it
    through and stays usable): its plan is settled as a lost step's, and the interrupt goes on. Its requests are left
    to the caller."""
    settle_the_plan(engine, plan)


def settle_the_plan(engine: Engine, plan: TransferPlan) -> None:
    """Run what of a lost step's plan its step did not run, then unpin its pages. Under TP it is only unpinned: run on
    rank 0 alone, which the followers never did, it would set the ranks' KV apart (every rank stops after it). If
    the moves fail again, the requests whose pages they write are failed (`requests_the_unrun_moves_write`)."""
    try:
        if engine._followers is None and not plan.has_run():
            try:
                with torch.inference_mode():
                    engine.runner.run_plan_of_a_lost_step(plan)
            except Exception as failure:
                hit = requests_the_unrun_moves_write(engine, plan)
                log.exception("a lost step's moves failed again; failing the requests whose KV they move %s",
                              [r.request_id for r in hit])
                engine._fail(hit, failure)
    finally:
        engine.kv.finish_plan(plan)


def requests_the_unrun_moves_write(engine: Engine, plan: TransferPlan) -> list[Request]:
    """The live requests holding a page that a stage of `plan` not yet run writes (swap targets, copy targets)."""
    written = {move.dst for move in plan.moves() if EXECUTION_ORDER.index(move.kind) >= plan.stages_run}
    return [engine.requests[rid] for rid, seq in engine.kv.seqs.items()
            if rid in engine.requests and not written.isdisjoint(seq.pages)]


def stop_every_rank(followers: Followers, error: Exception) -> None:
    """Stop every tensor-parallel rank after a lost step and raise `TensorParallelFailure` (`error` itself when it is
    one: a follower's death, named)."""
    failure = error if isinstance(error, TensorParallelFailure) else followers.failure(error)
    followers.close(graceful=False)
    raise failure from error
