"""Where W7's time goes (`bench_decide.py`'s two slowest rows): 32 decides over 4 new materials submitted at once,
and a cold decide in deterministic mode.

Not a benchmark. Each case runs warm first, then timed a few times, then once under cProfile (the host's
functions by own time) and once under torch.profiler (the device's kernels and the GPU's busy time). A case whose
wall time is far above its GPU time is host-bound. `--smoke` runs it on the CPU with the tiny checkpoint.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_decide import QUESTIONS, many_decides, material  # noqa: E402
from profile_steps import OUT, device_busy_ms, say  # noqa: E402

from prism.engine.llm import LLM  # noqa: E402
from prism.testing.checkpoints import build_checkpoint, ensure_tiny_checkpoint  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_ms(fn) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def examine(label: str, make_run, repeats: int, rows: int) -> None:
    """`make_run()` returns a fresh zero-argument run (new materials each time, so every run is cold for them)."""
    times = [wall_ms(make_run()) for _ in range(repeats)]
    say(f"\n=== {label}: wall {statistics.median(times):.1f} ms (median of {times and [round(t, 1) for t in times]})")
    host = cProfile.Profile()
    run = make_run()
    sync()
    host.enable()
    run()
    sync()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(rows)
    say(text.getvalue())
    pstats.Stats(host, stream=(text := io.StringIO())).sort_stats("cumulative").print_stats(rows)
    say(text.getvalue())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    run = make_run()
    with profile(activities=activities) as prof:
        run()
        sync()
    averages = prof.key_averages()
    busy = device_busy_ms(prof)
    say(f"--- {label}: GPU busy {busy:.1f} ms (under the profiler)")
    say(averages.table(sort_by="self_device_time_total" if busy else "self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default="/tmp/prism-bench/qwen3vl-8b-random")
    parser.add_argument("--out", default="bench/results/profile-decide.txt")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny checkpoint, one repeat")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--only", choices=("burst", "deterministic"), help="profile one case of the two")
    parser.add_argument("--repeats", type=int, help="timed runs per case (default 3 on the GPU, 1 with --smoke)")
    args = parser.parse_args()
    if args.smoke:
        ckpt, kw, repeats = ensure_tiny_checkpoint(), {"kv_dtype": "fp32", "page_size": 16}, args.repeats or 1
    else:
        ckpt, kw, repeats = Path(args.ckpt), {"kv_memory_bytes": 24 * 2**30, "page_size": 256}, args.repeats or 3
        if not (ckpt / "config.json").exists():
            build_checkpoint("8b", ckpt, device="cuda", progress=True)
    seeds = iter(range(10_000, 10**6, 100))

    if args.only in (None, "burst"):
        llm = LLM(ckpt, max_num_seqs=128, max_num_batched_tokens=16384, **kw)
        llm.decide(material(999), QUESTIONS)
        many_decides(llm, next(seeds))  # the first burst's first uses out of the way
        examine("32 decides over 4 new materials, submitted at once",
                lambda: functools.partial(many_decides, llm, next(seeds)), repeats, args.rows)
        llm = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.only in (None, "deterministic"):
        det = LLM(ckpt, deterministic=True, **kw)
        det.decide(material(998), QUESTIONS)
        examine("deterministic mode, one decide of a new material",
                lambda: functools.partial(det.decide, material(next(seeds)), QUESTIONS), repeats, args.rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(OUT))


if __name__ == "__main__":
    main()
