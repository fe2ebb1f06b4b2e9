"""Spec of *a KV pool is allocated only where it fits* (`prism.distributed.capacity.allocate_kv_pools`: the device
pool, then the CPU swap pool, each through `allocate_agreed_pool`), on the real code, with its planted bugs.

Ranks are threads whose collectives really exchange values (`prism.testing.thread_ranks`); each rank is given its
own free device memory (a number, or unknown as on the CPU) and an allocator that may run out of memory (torch's
`OutOfMemoryError`, or the CPU allocator's "can't allocate memory" RuntimeError, which the free-memory snapshot
cannot foresee) or fail otherwise (a CUDA error), for the device pool and for the swap pool of `num_cpu_pages` (no
free-memory query: only its allocation is agreed). For any world size, pools and per-rank memory: either every rank
gets a device pool of the layout's pages plus the scratch pages and its swap pool, or every rank fails: with the same
`KVCapacityError` naming the config key (`num_cpu_pages` for the swap pool), the bytes asked and the least free bytes
when memory was the reason, else the failing rank with its own error and the others with `AnotherRankFailed` (none
left waiting in a collective); no rank allocates a device pool larger than the least free memory, and no pool
survives a failed start (not even while its error is held).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.distributed import capacity
from prism.kv.fp8 import KVLayout, KVPool
from prism.testing.thread_ranks import ThreadWorld

# Tiny fp32 pools: a page of 2 layers x 1 head x 4 dims x 2 slots.
LAYOUTS = st.builds(lambda pages: KVLayout(2, 1, 4, 2, pages, "fp32"), st.integers(1, 6))


# The ways a rank's allocation fails: not, torch's out-of-memory, the CPU allocator's, another error.
FAILURES = st.sampled_from([False, False, "oom", "host oom", "other"])
OTHER = "planted: CUDA error: an illegal memory access was encountered"
CPU_PAGES = (10, 11)  # more than any device pool of LAYOUTS (6 + 2 scratch): the spec's allocator tells them apart


@st.composite
def worlds(draw: st.DrawFn) -> tuple[KVLayout, int, list[int | None], list, int, list]:
    layout, scratch = draw(LAYOUTS), draw(st.integers(0, 2))
    need = layout.with_num_pages(layout.num_pages + scratch).total_bytes
    size = draw(st.integers(1, 3))
    free = draw(st.lists(st.one_of(st.none(), st.sampled_from([0, need - 1, need, need + 1, 10 * need])),
                         min_size=size, max_size=size))
    oom = draw(st.lists(FAILURES, min_size=size, max_size=size))
    cpu_pages = draw(st.sampled_from([0, *CPU_PAGES]))
    cpu_oom = draw(st.lists(FAILURES, min_size=size, max_size=size)) if cpu_pages else [False] * size
    return layout, scratch, free, oom, cpu_pages, cpu_oom


def _fail(failure) -> None:
    if failure == "other":
        raise RuntimeError(OTHER)
    if failure == "host oom":
        raise RuntimeError("planted: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 1125899906842624 bytes")
    if failure:
        raise torch.OutOfMemoryError("planted: CUDA out of memory. Tried to allocate ...")


def set_up(layout: KVLayout, scratch: int, free: list[int | None], oom: list, cpu_pages: int, cpu_oom: list):
    """Run the real allocation on every rank: (per-rank results, the pools allocated, the device layouts asked
    for)."""
    world = ThreadWorld(len(free), timeout_s=5.0)
    pools: list[weakref.ref] = []
    asked: list[KVLayout] = []

    def rank_set_up(rank):
        def allocate(whole: KVLayout, device: torch.device) -> KVPool:
            swap = whole.num_pages in CPU_PAGES
            if not swap:
                asked.append(whole)
            _fail((cpu_oom if swap else oom)[rank.rank])
            pool = KVPool.allocate(whole, device)
            pools.append(weakref.ref(pool.payload))
            return pool

        return capacity.allocate_kv_pools(rank, layout, torch.device("cpu"), cpu_pages, key="kv_memory_bytes",
                                          value=12345, scratch_pages=scratch, free_bytes=lambda device: free[rank.rank],
                                          allocate=allocate)

    return world.run(rank_set_up), pools, asked


def _check_failure(errors: list[BaseException], failures: list, key: str, whole: KVLayout, least: int | None,
                   case: str) -> None:
    """Every rank failed at one pool (`failures`: each rank's allocation there): its own error for the rank whose
    allocation failed otherwise and AnotherRankFailed for the rest, or the same KVCapacityError naming the pool."""
    if "other" in failures:
        for failure, error in zip(failures, errors, strict=True):
            expected = RuntimeError if failure == "other" else capacity.AnotherRankFailed
            assert type(error) is expected, f"{case}: a rank failed with {error!r}, not {expected.__name__}"
        return
    assert all(isinstance(e, capacity.KVCapacityError) for e in errors), f"{case}: {errors}"
    assert len({str(e) for e in errors}) == 1, f"{case}: ranks fail with different errors: {errors}"
    message = str(errors[0])
    assert key in message and f" {whole.total_bytes} bytes (" in message, (
        f"{case}: the message names neither {key} nor the bytes asked: {message}")
    if least is not None:
        assert f"({least} bytes (" in message, f"{case}: the message does not name the {least} bytes free: {message}"


@settings(max_examples=150, deadline=None, report_multiple_bugs=False)
@given(world=worlds())
def spec_a_pool_is_allocated_on_every_rank_or_every_rank_refuses_it(world) -> None:
    layout, scratch, free, oom, cpu_pages, cpu_oom = world
    case = f"free {free}, oom {oom}, num_cpu_pages {cpu_pages}, swap pool failures {cpu_oom}"
    results, pools, asked = set_up(layout, scratch, free, oom, cpu_pages, cpu_oom)
    whole = layout.with_num_pages(layout.num_pages + scratch)
    known = [f for f in free if f is not None]
    least = min(known, default=None)
    fits = least is None or whole.total_bytes <= least
    kinds = {kind for kind, _ in results}
    assert len(kinds) == 1, f"{case}: ranks disagree on the start: {results}"
    assert all(a.total_bytes <= least for a in asked) if least is not None else True, (
        f"free {free}: a rank allocated {[a.total_bytes for a in asked]} bytes, more than the least free {least}")
    if fits and not any(oom) and not any(cpu_oom):
        assert kinds == {"ok"}, f"{case}: the pools fit but: {results}"
        for _, (pool, swap) in results:
            assert pool.layout == whole, f"a rank allocated {pool.layout}, not {whole}"
            assert (swap is None if not cpu_pages else swap.layout == layout.with_num_pages(cpu_pages)), (
                f"{case}: a rank's swap pool is {swap and swap.layout}")
        return
    assert kinds == {"error"}, f"{case}: the pools cannot be allocated everywhere but {results}"
    errors = [e for _, e in results]
    if fits and not any(oom):  # the device pool was allocated everywhere: the swap pool failed
        _check_failure(errors, cpu_oom, f"num_cpu_pages={cpu_pages}", layout.with_num_pages(cpu_pages), None, case)
    else:
        _check_failure(errors, oom if fits else [False] * len(oom), "kv_memory_bytes=12345", whole, least, case)
    gc.collect()
    kept = [p for p in pools if p() is not None]
    assert not kept, f"{case}: {len(kept)} pool(s) outlived the failed start while its error lives"


# ------------------------------------------------------------------------------------------ planted bugs
def _spec_fails(match: str, errors: type[BaseException] | tuple[type[BaseException], ...] = AssertionError) -> None:
    from specs.planted import _spec_fails as fails

    fails(spec_a_pool_is_allocated_on_every_rank_or_every_rank_refuses_it, match, errors)


def test_no_check_before_the_allocation_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug of the review: the pool went to torch's allocator whatever the device had free."""
    real = capacity.allocate_agreed_pool

    def unchecked(group, layout, device, **kw):
        return real(group, layout, device, **{**kw, "free_bytes": lambda device: None})

    monkeypatch.setattr(capacity, "allocate_agreed_pool", unchecked)
    _spec_fails("more than the least free|does not name the .* bytes free")


class _Alone:
    """A group of one: a rank that asks it agrees with nobody."""

    world_size = 1

    def min_int(self, value: int) -> int:
        return value


def test_each_rank_checking_only_its_own_memory_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose device cannot hold the pool (or whose allocation ran out of memory) stops alone; the others
    allocate and go on, to wait for it in their next collective."""
    real = capacity.allocate_agreed_pool
    monkeypatch.setattr(capacity, "allocate_agreed_pool", lambda group, *a, **kw: real(_Alone(), *a, **kw))
    _spec_fails("disagree|more than the least free")


def test_an_out_of_memory_on_one_rank_alone_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The free memory agreed, but not the allocation's own out-of-memory (the second collective)."""

    class FirstCollectiveOnly:
        def __init__(self, group):
            self.group, self.world_size, self.calls = group, group.world_size, 0

        def min_int(self, value: int) -> int:
            self.calls += 1
            return self.group.min_int(value) if self.calls == 1 else value

    real = capacity.allocate_agreed_pool
    monkeypatch.setattr(capacity, "allocate_agreed_pool",
                        lambda group, *a, **kw: real(FirstCollectiveOnly(group), *a, **kw))
    _spec_fails("disagree")


def test_a_pool_kept_by_a_failed_start_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank raises, but the pool a rank allocated stays in a frame of the error's traceback (as the pool's own
    local would without its `del`)."""
    real = capacity.allocate_agreed_pool

    def keeps_its_pool(group, layout, device, **kw):
        allocate, allocated = kw["allocate"], []

        def remembered(whole, dev):
            allocated.append(allocate(whole, dev))
            return allocated[-1]

        return real(group, layout, device, **{**kw, "allocate": remembered})

    monkeypatch.setattr(capacity, "allocate_agreed_pool", keeps_its_pool)
    _spec_fails("outlived the failed start")


def test_a_failure_other_than_out_of_memory_leaving_the_others_waiting_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The review of session 30: only torch's `OutOfMemoryError` was caught, so a rank whose allocation failed
    otherwise (a CUDA error, the CPU allocator's RuntimeError) left the agreement, and the others waited in its second collective
    until the group's timeout. Planted: the function as it was."""

    def only_out_of_memory_caught(group, layout, device, *, key, value, scratch_pages=0, free_bytes=None,
                                  allocate=None, memory="device"):
        whole = layout.with_num_pages(layout.num_pages + scratch_pages)
        local_free = free_bytes(device)
        least_free = group.min_int(capacity.UNKNOWN_FREE if local_free is None else max(local_free, 0))
        pool = None
        if whole.total_bytes <= least_free:
            try:
                pool = allocate(whole, device)
            except torch.OutOfMemoryError:
                pass
        if group.min_int(int(pool is not None)) == 1:
            return pool
        del pool
        raise capacity.KVCapacityError(f"kv_memory_bytes={value}: {whole.total_bytes} bytes ({least_free} bytes (")

    monkeypatch.setattr(capacity, "allocate_agreed_pool", only_out_of_memory_caught)
    _spec_fails("failed with|disagree")


def test_a_swap_pool_allocated_by_each_rank_alone_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The review of session 31: the CPU swap pool was allocated after the agreed device pool without an agreement,
    so a rank whose allocation failed raised alone while the others went on to their next collective."""
    real = capacity.allocate_agreed_pool

    def swap_pool_alone(group, *a, key, **kw):
        if key != "num_cpu_pages":
            return real(group, *a, key=key, **kw)
        return kw["allocate"](a[0], a[1])

    monkeypatch.setattr(capacity, "allocate_agreed_pool", swap_pool_alone)
    _spec_fails(r"disagree|: \[(OutOfMemoryError|RuntimeError)\(")  # or alone, torch's error, untyped


def test_a_device_pool_kept_by_a_failed_swap_pool_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank fails at the swap pool, but the device pool allocated before it stays referenced while the error
    lives (as the runner's attribute would, or `allocate_kv_pools`' local without its `del`)."""
    real, kept = capacity.allocate_agreed_pool, []

    def keeps_the_device_pool(group, *a, key, **kw):
        pool = real(group, *a, key=key, **kw)
        if key != "num_cpu_pages":
            kept.append(pool)
        return pool

    monkeypatch.setattr(capacity, "allocate_agreed_pool", keeps_the_device_pool)
    _spec_fails("outlived the failed start")


def test_the_cpu_allocators_out_of_memory_as_another_failure_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only torch's OutOfMemoryError counted as out of memory: a swap pool larger than the host fails its rank with
    the allocator's RuntimeError and the others with AnotherRankFailed, naming no setting."""
    monkeypatch.setattr(capacity, "_OUT_OF_MEMORY_LINES", ())
    _spec_fails(r"RuntimeError\(\"planted: \[enforce fail")
