"""Shared by the reproducers: make `prism` importable from a checkout and report a verdict."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT / "src", ROOT):  # the package, and the specs whose harnesses some reproducers reuse
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def verdict(ok: bool, fixed: str, broken: str) -> None:
    if ok:
        print(f"OK: {fixed}")
        sys.exit(0)
    print(f"BUG: {broken}", file=sys.stderr)
    sys.exit(1)


def liveness_verdict(requests, arrivals, what: str, **run_kwargs) -> None:
    """Run the liveness spec's scheduler harness on one fixed case; every request must terminate."""
    from specs.spec_scheduler_liveness import run

    try:
        stats = run(requests, arrivals, cancels={}, **run_kwargs)
        ok, detail = True, f"{stats['steps']} steps, {stats['preemptions']} preemption(s)"
    except AssertionError as error:
        ok, detail = False, str(error)
    verdict(ok, f"{what} ({detail})", detail)



TP_CPU = dict(tensor_parallel_size=2, device="cpu", num_gpu_pages=32, page_size=4, max_num_batched_tokens=160)


def start_tp_with_fault(fault: str, timeout_s: float):
    """Start a TP2 engine on the CPU (gloo) whose rank 1 runs `prism.testing.tp_faults`' `fault`: (the LLM if it
    started, the TensorParallelFailure if not, the seconds it took)."""
    import time

    import torch

    from prism.engine.llm import LLM
    from prism.engine.tp_workers import TensorParallelFailure
    from prism.testing.checkpoints import ensure_tiny_checkpoint
    from prism.testing.tp_faults import dying_follower

    torch.set_num_threads(1)
    start = time.perf_counter()
    llm, raised = None, None
    try:
        with dying_follower(fault):
            llm = LLM(ensure_tiny_checkpoint(), **TP_CPU, distributed_timeout_s=timeout_s)
    except TensorParallelFailure as error:
        raised = error
    return llm, raised, time.perf_counter() - start


def what_a_failed_tp_start_left(timeout_s: float) -> tuple[list[str], bool, int]:
    """After a failed TP start: (its followers still running, whether it left a group initialized, the tokens a new
    TP engine of this process generates for a 2-token greedy request)."""
    import torch.distributed as dist

    from prism.engine.llm import LLM
    from prism.engine.sampling import SamplingParams
    from prism.testing.checkpoints import ensure_tiny_checkpoint
    from prism.testing.tp_faults import live_followers

    left, group_left = live_followers(), dist.is_initialized()
    llm = LLM(ensure_tiny_checkpoint(), **TP_CPU, distributed_timeout_s=timeout_s)
    try:
        (out,) = llm.generate(["Hello there"], SamplingParams.greedy(max_tokens=2, ignore_eos=True))
    finally:
        llm.engine.shutdown()
    return left, group_left, len(out.token_ids)
