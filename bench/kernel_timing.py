"""Shared by the kernel sweeps (`tune_*_attention.py`): a scaled-FP8 pool of random finite payloads, and the time
of one launch measured inside a CUDA graph, so launch overhead does not hide the kernel."""

from __future__ import annotations

import torch

from prism.kv.fp8 import KVLayout, KVPool


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
