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
