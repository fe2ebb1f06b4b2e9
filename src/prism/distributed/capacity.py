"""KV capacity agreement across tensor-parallel ranks, and the pool's allocation where it fits.

Owns invariant 10 (*TP capacity*): every rank allocates the MIN page count over all ranks, agreed
before any pool is allocated; a rank that has room for no page still joins the agreement, and then
every rank raises the same `KVCapacityError` (nobody allocates, nobody waits on a rank that left).
Rank 0's KV manager hands out page ids that address every rank's pool, so a rank with more pages than
another would let page ids point past the smaller pool (divergent KV, or a rank stuck in a collective).

Also owns *a KV pool is allocated only where it fits* (`allocate_agreed_pool`): the ranks agree on the least
free device memory before any allocates, and on whether every allocation succeeded after; a pool larger than a
device (or than what the weights left) makes every rank raise the same `KVCapacityError` naming the setting, the
bytes asked and the bytes free, instead of torch's allocator error on one rank while the others go on, and no
rank keeps a pool. The CPU swap pool (`num_cpu_pages`, pinned when the engine is on CUDA) is agreed the same way
after it (`allocate_kv_pools`), without a free-memory query: a rank whose host cannot give it fails every rank, and
the device pool allocated before it is dropped. `specs/spec_kv_pool_memory.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch

from ..kv.fp8 import KVLayout, KVPool

# What a rank that cannot query its free memory (the CPU) brings to the agreement: no limit.
UNKNOWN_FREE = 2**62


class KVCapacityError(ValueError):
    """The KV pool cannot be allocated on at least one rank (no page fits its budget, or the pool does not fit in
    its device's memory): the engine cannot start on any rank (a configuration problem, hence a ValueError like
    `ConfigError`)."""


class MinGroup(Protocol):
    world_size: int

    def min_int(self, value: int) -> int: ...


def agree_num_pages(group: MinGroup, local_pages: int) -> int:
    """The page count every rank allocates: min over ranks of `local_pages` (one collective).

    Raises KVCapacityError on every rank, with the same message, when the minimum is 0.
    """
    if isinstance(local_pages, bool) or not isinstance(local_pages, int) or local_pages < 0:
        raise ValueError(f"local_pages must be a non-negative int, got {local_pages!r}")
    agreed = group.min_int(local_pages)
    if agreed < 1:
        raise KVCapacityError(
            f"no KV page fits on at least one of the {group.world_size} tensor-parallel ranks (min pages = 0); "
            "every rank stops: raise kv_memory_bytes / num_gpu_pages or lower page_size"
        )
    return agreed


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes torch can still allocate on `device`: the driver's free memory plus the blocks torch's caching allocator
    holds unused (it gives them back before it reports an out-of-memory). None off CUDA: the host's "free" memory
    says little about what an allocation gets (overcommit, swap, other processes)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def no_free_memory_query(device: torch.device) -> None:
    """The host's free memory: unknown (overcommit, swap, other processes), so only the allocation itself is agreed."""
    return None


def allocate_kv_pools(group: MinGroup, layout: KVLayout, device: torch.device, num_cpu_pages: int, *, key: str,
                      value: int, scratch_pages: int = 0,
                      free_bytes: Callable[[torch.device], int | None] | None = None,
                      allocate: Callable[[KVLayout, torch.device], KVPool] | None = None
                      ) -> tuple[KVPool, KVPool | None]:
    """This rank's device pool (`allocate_agreed_pool`) and its CPU swap pool of `num_cpu_pages` (None for 0; pinned
    when `device` is CUDA), each allocated on every rank or on none: every rank raises together, and a failed swap
    pool drops the device pool first (no pool outlives a failed start while its error lives). `free_bytes` (the
    device's), `allocate` (both pools'): as `allocate_agreed_pool` takes them."""
    gpu_pool = allocate_agreed_pool(group, layout, device, key=key, value=value, scratch_pages=scratch_pages,
                                    free_bytes=free_bytes, allocate=allocate)
    if not num_cpu_pages:
        return gpu_pool, None
    try:
        cpu_pool = allocate_agreed_pool(
            group, layout.with_num_pages(num_cpu_pages), torch.device("cpu"), key="num_cpu_pages",
            value=num_cpu_pages, free_bytes=no_free_memory_query, memory="host",
            allocate=allocate or functools.partial(KVPool.allocate, pin_memory=device.type == "cuda"))
    except BaseException:
        del gpu_pool
        raise
    return gpu_pool, cpu_pool


def allocate_agreed_pool(group: MinGroup, layout: KVLayout, device: torch.device, *, key: str, value: int,
                         scratch_pages: int = 0,
                         free_bytes: Callable[[torch.device], int | None] | None = None,
                         allocate: Callable[[KVLayout, torch.device], KVPool] | None = None,
                         memory: str = "device") -> KVPool:
    """This rank's KV pool: `layout`'s pages plus `scratch_pages` (what the CUDA graphs' padding writes), allocated on
    `device` only if it fits on every rank. `key`, `value`: the config key that sized it and its value, for the
    message. `free_bytes`, `allocate`: this module's `device_free_bytes` and `KVPool.allocate` unless given (the
    specs give each rank its own). `memory`: "device", or "host" for the CPU swap pool (the message's words).

    Two collectives, at the same point on every rank: the least free memory over ranks, before any allocates (a pool
    larger than it raises before anything is allocated); then whether every rank's allocation succeeded (the free
    memory is a snapshot: another process may take some, and a large block may not be contiguous), so a rank whose
    allocation ran out of memory fails every rank, and those that allocated drop their pool first.

    No margin is kept for what the start allocates after the pool (warm-up activations, CUDA graph pools, logits
    buffers) and what serving fills (the encoder cache): those depend on the model, the configuration and the
    torch/Triton versions, and a guessed margin would refuse pools that work or pass pools that do not. This check
    refuses the pools that cannot be allocated at all (a size in the wrong unit, or meant for a larger device);
    README says how much to leave. Raises KVCapacityError on every rank, with the same message."""
    whole = layout.with_num_pages(layout.num_pages + scratch_pages)
    # Every rank reaches both collectives whatever fails here: a rank raising between them would leave the others
    # waiting in the second one until the group's timeout. The second agrees on the worst outcome: a failure that is
    # not an out-of-memory (a CUDA error, a bad argument) is re-raised as itself by its rank, and the other ranks
    # raise AnotherRankFailed.
    other: Exception | None = None
    try:
        local_free = (free_bytes or device_free_bytes)(device)
    except Exception as error:
        local_free, other = 0, error
    least_free = group.min_int(UNKNOWN_FREE if local_free is None else max(local_free, 0))
    fits = whole.total_bytes <= least_free and other is None
    pool, failed = None, None
    if fits:
        try:
            pool = (allocate or KVPool.allocate)(whole, device)
        except Exception as error:  # caught, not kept: its traceback would hold what was allocated
            if _out_of_memory(error):
                failed = str(error).splitlines()[0] if str(error) else "out of memory"
            else:
                other = error
    outcome = group.min_int(_ALLOCATED if pool is not None else _FAILED if other is not None else _NO_ROOM)
    if outcome == _ALLOCATED:
        return pool
    del pool  # a rank that allocated keeps nothing while the error lives
    if other is not None:
        raise other
    if outcome == _FAILED:
        raise AnotherRankFailed("another tensor-parallel rank failed to allocate its KV pool (not for want of "
                                "memory: that rank's error says why); every rank stops")
    raise KVCapacityError(_does_not_fit(group, whole, layout.num_pages, key, value, least_free, allocated=fits,
                                        memory=memory)
                          + (f" (the allocator: {failed})" if failed and group.world_size == 1 else ""))


# The allocators' out-of-memory errors that are not torch.OutOfMemoryError (the CUDA caching allocator's): the CPU
# allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes"), and a
# pinned host allocation's CUDA error. The pool is larger than its memory, a configuration problem like a device pool
# that does not fit: the same typed error naming its setting, not the allocator's line on one rank.
_OUT_OF_MEMORY_LINES = ("can't allocate memory", "CUDA error: out of memory")


def _out_of_memory(error: Exception) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and any(line in str(error) for line in _OUT_OF_MEMORY_LINES))


# The ranks' outcomes, ordered so that the MIN over ranks is the worst.
_FAILED, _NO_ROOM, _ALLOCATED = 0, 1, 2


class AnotherRankFailed(RuntimeError):
    """A rank's KV pool allocation failed for another reason than memory: the other ranks stop with this."""


def _does_not_fit(group: MinGroup, whole: KVLayout, pages: int, key: str, value: int, least_free: int,
                  allocated: bool, memory: str = "device") -> str:
    """The same message on every rank: the numbers are agreed ones, nothing is rank-specific."""
    machine = "the device" if memory == "device" else "the host"
    where = machine if group.world_size == 1 else f"{machine} of one of the {group.world_size} tensor-parallel ranks"
    free = ("no free-memory query off CUDA" if memory == "device" and least_free >= UNKNOWN_FREE
            else "no free-memory query for host memory" if least_free >= UNKNOWN_FREE
            else f"{_bytes(least_free)} free after the model's weights")
    scratch = whole.num_pages - pages
    scratch_note = (f" + {scratch} scratch page(s) that the CUDA graphs' padding writes (cuda_graph_max_batch, "
                    "cuda_graph_max_packed_tokens)" if scratch else "")
    what = "ran out of memory allocating it" if allocated else "cannot hold it"
    pool, room = (("KV pool", ", leaving room for activations and CUDA graphs") if memory == "device"
                  else ("CPU swap pool", ""))
    return (f"the {pool} does not fit in {memory} memory: {key}={value} gives {pages} pages{scratch_note} of "
            f"{whole.page_bytes} bytes, {_bytes(whole.total_bytes)} asked, and {where} {what} ({free}); every "
            f"rank stops: lower {key}{room}")


def _bytes(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)"
