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


def profile_cold_request_steps(out: Path) -> None:
    """Profile every step from the cold request's arrival to its first token (the encoding ahead, the chunks), each
    step a `record_function` range, and write the tables and the host/device timeline (`profile_hot_paths.timeline`)
    of the first engine that runs; later engines run unprofiled."""
    from profile_hot_paths import timeline
    from torch.profiler import ProfilerActivity, profile, record_function

    from prism.engine.engine import Engine

    step, state = Engine.step, {"prof": None, "n": 0, "done": False}

    def profiled_step(self):
        cold = self.requests.get("cold")
        if cold is None or state["done"]:
            return step(self)
        if state["prof"] is None:
            cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            state["prof"] = profile(activities=[ProfilerActivity.CPU, *cuda])
            state["prof"].__enter__()
        with record_function(f"engine.step.{state['n']}"):
            events = step(self)
        state["n"] += 1
        if cold.output_token_ids:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof = state["prof"]
            prof.__exit__(None, None, None)
            state["done"] = True
            out.mkdir(parents=True, exist_ok=True)
            tables = (prof.key_averages().table(sort_by="cpu_time_total", row_limit=40) + "\n\n"
                      + prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
            (out / "w4-cold-steps.txt").write_text(tables + "\n\n" + timeline(prof))
            print(timeline(prof), flush=True)
        return events

    Engine.step = profiled_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--interleave", type=int, default=256)
    parser.add_argument("--profile", type=Path, default=None,
                        help="write a profile of the first engine's steps around the cold request here")
    args = parser.parse_args()
    if args.profile is not None:
        profile_cold_request_steps(args.profile)
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
