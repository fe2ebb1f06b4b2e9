"""Spec: a failed step loses only its own requests (REFERENCE §2, "nothing is lost"; invariant 5's executor half).

The real engine on the tiny checkpoint, a small pool with swap preemption, a few greedy requests that outgrow it.
One step fails, the k-th step whose plan swaps pages out, or swaps them in, or any k-th step: either while it is
built (`ModelRunner.prepare` raises), or while its plan's moves run (the swaps of the chosen direction move half of
their pages, then raise), or so and again when the lost step's plan is settled (a failure that repeats). The
requests of that step fail; every other live request must come out of it with the KV it had (its pages' bytes,
wherever the plan moved them) or fail with it (a request whose pages the moves that failed again write), and the
engine must go on: every request ends once, no page is leaked.

The historical bugs: the plan was taken from the KV manager before the step was built and its moves run only when
the step ran, so a request the failed step had swapped out (not one of its requests) resumed from CPU pages that
never received its KV. Then (found by review, session 31; fixed in session 32) a plan was marked run as its first
move began: a step whose swap-ins ran and whose swap-outs raised left the swapped-out request the same CPU pages.
And (found by review, session 32) moves that failed again when settled raised out of `Engine.step`, leaving the
swapped-out request live on those pages.
"""

from __future__ import annotations

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from prism.engine.config import EngineConfig
from prism.engine.engine import Engine
from prism.engine.sampling import SamplingParams
from prism.kv import transfers
from prism.testing.checkpoints import ensure_tiny_checkpoint

TEXTS = ["Tell me a long story about the sea.", "Count slowly from one to a hundred.", "Name every colour.",
         "Why is the sky blue?"]


def kv_bytes(runner, seq) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The payload (and scales) of each page of a sequence, from whichever pool holds it."""
    out = []
    for pool_name, page in seq.pages:
        pool = runner.gpu_pool if pool_name == "gpu" else runner.cpu_pool
        out.append((pool.payload[:, :, page].clone(), None if pool.scales is None else pool.scales[:, :, page].clone()))
    return out


FAILURES = ["while it is built", "while its plan runs", "while its plan runs, and again when it is settled"]


@settings(max_examples=20, deadline=None)
@given(num_requests=st.integers(3, 4), max_tokens=st.integers(24, 48), k=st.integers(0, 1), case=st.sampled_from(
    [(FAILURES[0], "any")] + [(failure, swaps) for failure in FAILURES for swaps in ("swap_out", "swap_in")]))
def spec_a_failed_step_leaves_the_other_requests_kv_intact(num_requests, max_tokens, k, case) -> None:
    failure, fail_when = case  # any step may fail while it is built; only a plan's swaps fail while they run
    torch.manual_seed(0)
    engine = Engine(ensure_tiny_checkpoint(), EngineConfig(
        page_size=4, num_gpu_pages=24, num_cpu_pages=32, preemption="swap", max_num_seqs=4,
        max_num_batched_tokens=64, check_invariants=True))
    runner = engine.runner
    prepare, swap_pages = runner.prepare, transfers.swap_pages
    failed_step: dict = {}
    building: dict = {}

    def fails_once(plan, slices, kv_, *args, **kwargs):
        building["requests"] = {s.request.request_id for s in slices}
        matches = fail_when == "any" or bool(getattr(plan, fail_when))
        if matches and not failed_step:
            building["matching"] = building.get("matching", 0) + 1
            if building["matching"] > k:
                failed_step.update(requests=building["requests"], swapped=bool(plan.swap_out or plan.swap_in),
                                   plan=plan)
                raise RuntimeError("a planted failure while the step is built")
        return prepare(plan, slices, kv_, *args, **kwargs)

    def swaps_half_then_fails(src, dst, src_pages, dst_pages):
        direction = "swap_out" if src is runner.gpu_pool else "swap_in"
        if direction == fail_when and (not failed_step or failure == FAILURES[2]):
            building["moving"] = building.get("moving", 0) + 1
            if building["moving"] > k:
                failed_step.update(requests=building["requests"], swapped=True)
                half = len(src_pages) // 2
                swap_pages(src, dst, src_pages[:half], dst_pages[:half])
                raise RuntimeError(f"a planted failure in the middle of the plan's {direction}")
        return swap_pages(src, dst, src_pages, dst_pages)

    if failure == FAILURES[0]:
        runner.prepare = fails_once
    else:
        runner.prepare = lambda plan, slices, *args, **kwargs: (
            building.update(requests={s.request.request_id for s in slices}), prepare(plan, slices, *args, **kwargs))[1]
        transfers.swap_pages = swaps_half_then_fails
    try:
        _run_until_every_request_ends(engine, num_requests, max_tokens, failed_step)
    finally:
        transfers.swap_pages = swap_pages
    event(f"a step failed {failure}" if failed_step else "no step matched")


def _run_until_every_request_ends(engine: Engine, num_requests: int, max_tokens: int, failed_step: dict) -> None:
    runner, kv = engine.runner, engine.kv
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"r{i}", [{"role": "user", "content": TEXTS[i]}], params)
    ends: dict[str, int] = {}
    checked = False
    for _ in range(1000):
        # each live request's KV before the step (its plan, taken while it is scheduled, moves pages)
        before_step = {rid: kv_bytes(runner, seq) for rid, seq in kv.seqs.items()} if not checked else {}
        for output in engine.step():
            ends[output.request_id] = ends.get(output.request_id, 0) + output.finished
        if failed_step and not checked:  # the step just failed: nothing has run on the pools since
            checked = True
            for rid, before in before_step.items():
                if rid in failed_step["requests"] or rid not in kv.seqs:
                    continue  # failed with the step, or preempted to recompute (its KV dropped)
                after = kv_bytes(runner, kv.seqs[rid])
                assert len(after) == len(before) and all(
                    torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))
                    for a, b in zip(after, before, strict=True)), \
                    f"request {rid}, not in the failed step, lost its KV ({len(before)} pages)"
        if not engine.has_unfinished_requests():
            break
    assert sorted(ends) == [f"r{i}" for i in range(num_requests)] and set(ends.values()) == {1}, ends
    if failed_step.get("swapped"):
        event("the failed step's plan moved pages")
    assert not kv.seqs
    kv.clear_cache()
    assert kv.gpu.num_free == kv.gpu.num_pages and kv.cpu.num_free == kv.cpu.num_pages, "pages leaked"
