"""Shared by the kernel sweeps (`tune_*_attention.py`): a scaled-FP8 pool of random finite payloads, the time of
one launch measured inside a CUDA graph (so launch overhead does not hide the kernel), and the sweep over a kernel
module's launch knobs with its report."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from types import ModuleType

import torch

from prism.kv.fp8 import KVLayout, KVPool
from prism.testing.knobs import module_knobs  # noqa: F401 (the sweeps import it from here too)


def random_fp8_pool(layout: KVLayout) -> KVPool:
    """A CUDA pool whose E4M3 payloads are random finite values of either sign and scales in [1e-3, 1e-2]."""
    pool = KVPool.allocate(layout, "cuda")
    sign = torch.randint(0, 2, pool.payload.shape, device="cuda", dtype=torch.uint8) << 7
    pool.payload.view(torch.uint8).copy_(torch.randint(0, 0x70, pool.payload.shape, device="cuda",
                                                       dtype=torch.uint8) | sign)
    pool.scales.uniform_(0.001, 0.01)
    return pool


def us_per_call_in_graph(call, calls: int = 20, replays: int = 5) -> float:
    """`call()` captured `calls` times in one CUDA graph (after one eager run that compiles it), the graph
    replayed `replays` times: microseconds per call."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)



def sweep_knobs(module: ModuleType, knobs: dict[str, tuple], splits: Iterable[int], default_splits: int,
                time_splits: Callable[[int], float], title: str) -> list[str]:
    """Time `time_splits(n)` for every combination of `module`'s launch knobs (attribute name -> values) and every
    split count n (`splits` and `default_splits`), the module's own values restored afterwards. Returns the
    report: the time of the current defaults, then the 12 fastest configurations."""
    names = list(knobs)
    defaults = tuple(getattr(module, name) for name in names)

    def describe(values) -> str:
        return " ".join(f"{name.strip('_')} {value!s:5}" for name, value in zip(names, values, strict=True))

    results = []
    for values in itertools.product(*knobs.values()):
        with module_knobs(module, dict(zip(names, values, strict=True))):
            for n in sorted({*splits, default_splits}):
                try:
                    us = time_splits(n)
                except Exception as error:  # a configuration the compiler refuses (shared memory...)
                    print(f"{title}: {describe(values)} splits {n}: {type(error).__name__}")
                    continue
                results.append((us, values, n))
    current = next((us for us, values, n in results if (values, n) == (defaults, default_splits)), float("nan"))
    results.sort(key=lambda r: r[0])
    return [f"== {title}: current defaults ({describe(defaults)} splits {default_splits}): {current:.1f} us"] + [
        f"  {us:7.1f} us  {describe(values)} splits {n:2d}" for us, values, n in results[:12]]


def copy_bandwidth() -> float:
    """Read + write bytes per second of an eager 4 GiB device copy: the decode floor's bandwidth
    (`profile_hot_paths.floors`, `decode_gemms.py`). Not in a CUDA graph: captured, a device-to-device copy
    becomes a memcpy node that ran at 2.7 TB/s instead of 4.3."""
    x = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) * 1e-3)
