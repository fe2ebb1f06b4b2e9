"""Found by review of the tensor-parallel start-up: the device KV pool is agreed across ranks (every rank allocates it
or every rank raises), but the CPU swap pool (`num_cpu_pages`) allocated right after it was not: a rank whose host
could not give it raised alone, while the others went on (rank 0's start even returned an engine whose follower was
gone, to wait for it in its first collective until `distributed_timeout_s`). Now the swap pool is agreed the same way:
every rank raises the same `KVCapacityError` naming `num_cpu_pages`, at once, and keeps no pool.

Two ranks on the CPU (gloo); rank 1's allocator fails the swap pool as the CPU allocator fails for want of memory."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable

TIMEOUT_S = 30.0  # distributed_timeout_s: the failure must come well before it


def main() -> None:
    import os
    import sys
    import time

    import torch

    from prism.engine.llm import LLM
    from prism.testing.checkpoints import ensure_tiny_checkpoint
    from prism.testing.tp_faults import dying_follower, live_followers

    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        with dying_follower("swap_pool_allocation_fails"):
            LLM(ensure_tiny_checkpoint(), device="cpu", tensor_parallel_size=2, num_gpu_pages=32, page_size=4,
                num_cpu_pages=7, distributed_timeout_s=TIMEOUT_S)
        outcome = "started"
    except Exception as error:  # noqa: BLE001 - the kind of error is the finding
        outcome = f"{type(error).__name__}: {error}"
    took = time.perf_counter() - started
    if outcome == "started":  # its follower is gone: its shutdown would wait for it
        print(f"BUG: rank 1's swap pool failed, yet rank 0 started an engine ({took:.1f} s)", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    ok = (outcome.startswith("KVCapacityError") and "num_cpu_pages=7" in outcome and took < TIMEOUT_S / 2
          and not live_followers())
    _common.verdict(ok, f"every rank failed in {took:.1f} s: {outcome}",
                    f"after {took:.1f} s (followers left: {live_followers()}): {outcome}")


if __name__ == "__main__":
    main()
