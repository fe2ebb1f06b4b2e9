"""W4 with interleaving, over several engines one after another in one process: each engine's longest gap and steps.

Session 8 found the first prefill chunk step after the images were encoded ahead taking 23-69 ms from one engine to
the next, where the chunks after it take 9-12 ms (`bench/RESULTS.md`, session 8). This script repeats the
measurement so that step can be profiled; it is not part of `nox -s bench`.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_workloads  # noqa: E402

from prism.testing.checkpoints import build_checkpoint  # noqa: E402
from prism.testing.gpu import release_gpu_memory  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--interleave", type=int, default=256)
    args = parser.parse_args()
    ckpt = bench_workloads.CKPT
    if not (ckpt / "config.json").exists():
        build_checkpoint("8b", ckpt, device="cuda", progress=True)
    for n in range(args.engines):
        gc.collect()
        release_gpu_memory()
        r = bench_workloads.w4_injection(ckpt, 448, 8, 16 * 2**30, interleave=args.interleave)
        steps = [round(r["gaps_ms"][i], 1) for i in range(32, 120, 8)]  # one gap per step (8 streams)
        retries = torch.cuda.memory_stats().get("num_alloc_retries")
        print(f"engine {n + 1}: max ITL {r['max_itl_ms']:.1f} ms, cold TTFT {r['cold_ttft_ms']:.1f} ms, "
              f"allocator retries {retries}, steps from 32: {steps}", flush=True)


if __name__ == "__main__":
    main()
