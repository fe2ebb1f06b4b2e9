"""Is W5 host-bound or device-bound on the GPU? (Not part of `nox -s bench`.)

Runs W5 of `bench_workloads.py` (default engine settings) per KV format twice, each in the same process:
1. the host's waits for sampled tokens timed (`InflightStep.host_result`, where the engine loop waits for the
   device): little waiting means the device idles while the host works;
2. the device's busy time, the union of its kernels' intervals from the profiler (CUDA activity only, from the
   first step to the last; the profiler slows the host a little, so this run's req/s is lower).
A host-bound W5 gains from less host work per step, a device-bound one from less device work per request. The first
run also lists the Triton kernels compiled or loaded after the engine's construction (first uses the engine did not
warm up); `TRITON_CACHE_DIR` pointing at an empty folder shows a fresh machine's cost.

    python bench/profile_w5.py [fp8] [bf16] [--smoke]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import bench_workloads  # noqa: E402

from prism.engine.engine import Engine  # noqa: E402
from prism.engine.inflight import InflightStep  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

SMOKE = "--smoke" in sys.argv


def run_w5(kv_dtype: str) -> dict:
    if SMOKE:
        return bench_workloads.w5_working_set(ensure_tiny_checkpoint(), kv_dtype, 2 * 2**20, 64, 6, 8, 40)
    return bench_workloads.w5_working_set(bench_workloads.CKPT, kv_dtype, 3 * 2**30, 448, 32, 32, 256)


def loop_seconds(result: dict) -> float:
    """W5's measured loop (the engine's construction excluded)."""
    requests = 40 if SMOKE else 256
    return requests / result["req_per_s"]


class TritonFirstUses:
    """Triton kernels compiled (or loaded from the disk cache) between `start` and `stop`: the specializations the
    engine's construction did not warm up, which the first requests pay for (`JITFunction._do_compile` runs on a
    miss of the in-memory cache only)."""

    def __init__(self) -> None:
        self.seconds, self.kernels = 0.0, []
        self.started = False
        self._stop = lambda: None

    def start(self) -> None:
        self.started = True
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:  # (no Triton: nothing to count)
            return
        compile_ = JITFunction._do_compile

        def timed(fn, key, signature, device, constexprs, options, attrs, warmup):
            start = time.perf_counter()
            try:
                return compile_(fn, key, signature, device, constexprs, options, attrs, warmup)
            finally:
                self.seconds += time.perf_counter() - start
                self.kernels.append(f"{fn.fn.__name__}{tuple(constexprs.values()) if constexprs else ''}")

        JITFunction._do_compile = timed
        self._stop = lambda: setattr(JITFunction, "_do_compile", compile_)

    def stop(self) -> None:
        self._stop()

    def summary(self) -> str:
        names = sorted(set(self.kernels))
        return (f"Triton kernels first used after construction: {len(self.kernels)} ({self.seconds * 1e3:.0f} ms): "
                f"{', '.join(names[:12])}{' ...' if len(names) > 12 else ''}")


def host_waits(kv_dtype: str) -> str:
    waited = {"seconds": 0.0, "reads": 0}
    read = InflightStep.host_result

    def timed_read(self):
        start = time.perf_counter()
        try:
            return read(self)
        finally:
            waited["seconds"] += time.perf_counter() - start
            waited["reads"] += 1

    InflightStep.host_result = timed_read
    step, first_uses = Engine.step, TritonFirstUses()

    def counted_step(self):  # from the first step: the engine's construction left out
        if not first_uses.started:
            first_uses.start()
        return step(self)

    Engine.step = counted_step
    try:
        result = run_w5(kv_dtype)
    finally:
        InflightStep.host_result, Engine.step = read, step
        first_uses.stop()
    loop = loop_seconds(result)
    return (f"{kv_dtype}: {result['req_per_s']:.1f} req/s, {result['steps']} steps ({loop / result['steps'] * 1e3:.1f} ms "
            f"each), the host waited for tokens {waited['seconds'] * 1e3:.0f} ms of {loop * 1e3:.0f} ms "
            f"({waited['seconds'] / loop:.0%}; {waited['reads']} reads)\n  {first_uses.summary()}")


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """The total length covered by `intervals` (microseconds in, seconds out)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total * 1e-6


def device_busy(kv_dtype: str) -> str:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    step = Engine.step
    span = {}

    def profiled_step(self):
        if "start" not in span:  # from the first step: the engine's construction and graph captures left out
            prof.start()
            span["start"] = time.perf_counter()
        return step(self)

    Engine.step = profiled_step
    try:
        result = run_w5(kv_dtype)
        torch.cuda.synchronize()
        span["end"] = time.perf_counter()
        prof.stop()
    finally:
        Engine.step = step
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy, wall = union_seconds(kernels), span["end"] - span["start"]
    return (f"{kv_dtype} (profiled): {result['req_per_s']:.1f} req/s; the device busy {busy * 1e3:.0f} ms of "
            f"{wall * 1e3:.0f} ms ({busy / wall:.0%}), {len(kernels)} kernels")


def main() -> None:
    formats = [a for a in sys.argv[1:] if a in ("fp8", "bf16")] or ["fp8", "bf16"]
    for kv_dtype in formats:
        print(host_waits(kv_dtype), flush=True)
        if torch.cuda.is_available():
            print(device_busy(kv_dtype), flush=True)


if __name__ == "__main__":
    main()
