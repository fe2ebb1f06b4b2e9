"""Tensor-parallel faults planted by the tests and reproducers.

Start-up (`engine/tp_startup.py`): each fault is a stand-in for `tp_workers.serve_worker` (a module-level function,
so a spawned process can import it): rank 1 dies at the named point of its start-up (or its KV pool does not fit in its
device's memory, or its CPU swap pool in its host's; or it dies after its KV pools, or raises while it warms up, both
after the last collective of a CPU rank's start), any other rank serves as usual.
`dying_follower(fault)` makes the engines built inside it spawn that stand-in. Steps: `lose_steps_after_their_payload`
and `lose_device_token_steps` make rank 0's runner fail a step after its payload went to the followers.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import torch


def _kill_myself(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _fail_loading(*args, **kwargs) -> None:
    raise RuntimeError("planted: rank 1 could not load its model")


def killed_before_joining(rank: int, address: str, model_dir: str, config: dict) -> None:
    from ..engine.tp_workers import serve_worker

    if rank == 1:
        _kill_myself()
    serve_worker(rank, address, model_dir, config)


def raises_while_loading(rank: int, address: str, model_dir: str, config: dict) -> None:
    from ..engine import rank as rank_setup
    from ..engine.tp_workers import serve_worker

    if rank == 1:
        rank_setup.load_model = _fail_loading
    serve_worker(rank, address, model_dir, config)


def killed_while_loading(rank: int, address: str, model_dir: str, config: dict) -> None:
    from ..engine import rank as rank_setup
    from ..engine.tp_workers import serve_worker

    if rank == 1:
        rank_setup.load_model = _kill_myself
    serve_worker(rank, address, model_dir, config)


def kv_pool_beyond_free_memory(rank: int, address: str, model_dir: str, config: dict) -> None:
    """Rank 1's device has no memory free for the KV pool (`capacity.device_free_bytes` says 0)."""
    from ..distributed import capacity
    from ..engine.tp_workers import serve_worker

    if rank == 1:
        capacity.device_free_bytes = lambda device: 0
    serve_worker(rank, address, model_dir, config)


def _out_of_memory(*args, **kwargs) -> None:
    raise torch.OutOfMemoryError("planted: CUDA out of memory. Tried to allocate the KV pool")


def kv_pool_allocation_out_of_memory(rank: int, address: str, model_dir: str, config: dict) -> None:
    """Rank 1's KV pool allocation runs out of memory (torch's error), which the free memory did not foresee."""
    from ..engine.tp_workers import serve_worker
    from ..kv.fp8 import KVPool

    if rank == 1:
        KVPool.allocate = _out_of_memory
    serve_worker(rank, address, model_dir, config)


CPU_ALLOCATOR_OUT_OF_MEMORY = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate {} bytes (planted)")


def failing_swap_pool(pages: int):
    """`KVPool.allocate` whose pools of `pages` pages (the CPU swap pool's `num_cpu_pages`) fail as the CPU
    allocator fails for want of memory; other pools are allocated."""
    from ..kv.fp8 import KVPool

    allocate = KVPool.allocate

    def swap_pool_fails(layout, *args, **kwargs):
        if layout.num_pages == pages:
            raise RuntimeError(CPU_ALLOCATOR_OUT_OF_MEMORY.format(layout.total_bytes))
        return allocate(layout, *args, **kwargs)

    return swap_pool_fails


def swap_pool_allocation_fails(rank: int, address: str, model_dir: str, config: dict) -> None:
    """Rank 1's CPU swap pool (`num_cpu_pages`) cannot be allocated: the CPU allocator's RuntimeError."""
    from ..engine.tp_workers import serve_worker
    from ..kv.fp8 import KVPool

    if rank == 1:
        KVPool.allocate = failing_swap_pool(config["num_cpu_pages"])
    serve_worker(rank, address, model_dir, config)


def killed_after_the_kv_pools(rank: int, address: str, model_dir: str, config: dict) -> None:
    """Rank 1 allocates its KV pools (every rank agreeing), then is killed: rank 0's start had nothing left to wait on
    the followers for, and returned an engine whose follower was dead (the bug of session 30)."""
    from ..engine import runner as runner_module
    from ..engine.tp_workers import serve_worker

    if rank == 1:
        allocate = runner_module.allocate_kv_pools

        def allocated_then_killed(*args, **kwargs):
            pools = allocate(*args, **kwargs)
            _kill_myself()
            return pools

        runner_module.allocate_kv_pools = allocated_then_killed
    serve_worker(rank, address, model_dir, config)


WARM_UP_FAILED = "planted: rank 1's warm-up failed"


def _warm_up_fails(*args, **kwargs) -> None:
    raise RuntimeError(WARM_UP_FAILED)


def raises_while_warming_up(rank: int, address: str, model_dir: str, config: dict) -> None:
    """Rank 1's runner raises once its KV pools are allocated, where it captures its decode graphs (on CUDA, with the
    warm-up forwards before each capture; on the CPU the capture is reached with `graph_rows_without_cuda`)."""
    from ..engine.cuda_graphs import RowGraphs
    from ..engine.tp_workers import serve_worker

    if rank == 1:
        RowGraphs.capture = _warm_up_fails
    serve_worker(rank, address, model_dir, config)


FAULTS = {f.__name__: f for f in (killed_before_joining, raises_while_loading, killed_while_loading,
                                  kv_pool_beyond_free_memory, kv_pool_allocation_out_of_memory,
                                  swap_pool_allocation_fails, killed_after_the_kv_pools, raises_while_warming_up)}


@contextlib.contextmanager
def dying_follower(fault: str) -> Iterator[None]:
    """Engines built inside spawn `FAULTS[fault]` as their followers."""
    from ..engine import tp_workers

    serve = tp_workers.serve_worker
    tp_workers.serve_worker = FAULTS[fault]
    try:
        yield
    finally:
        tp_workers.serve_worker = serve


LOST_STEP = "planted: lost after the payload went out"


def lose_steps_after_their_payload(runner) -> None:
    """Rank 0's `runner` raises `RuntimeError(LOST_STEP)` in every step with forwards, once the step's payload went
    out (the followers are inside its collectives)."""
    run = runner.run

    def fails_after_the_payload(payload, token_ids=None):
        if payload.forwards:
            raise RuntimeError(LOST_STEP)
        return run(payload, token_ids)

    runner.run = fails_after_the_payload


def lose_device_token_steps(runner) -> None:
    """Rank 0's `runner` raises `RuntimeError(LOST_STEP)` in every graph step fed device tokens (a step launched on
    tokens rank 0 has not read, after its payload went out)."""
    graph_step = runner._graph_step

    def fails_on_device_tokens(forward, token_ids=None):
        if token_ids is not None:
            raise RuntimeError(LOST_STEP)
        return graph_step(forward, token_ids)

    runner._graph_step = fails_on_device_tokens


def live_followers() -> list[str]:
    """The names of this process's follower ranks still running (reaping those that ended)."""
    import multiprocessing

    return [p.name for p in multiprocessing.active_children() if p.name.startswith("prism-tp-rank")]
