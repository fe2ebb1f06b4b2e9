"""A KV pool larger than the device's free memory: the engine's start refuses it with a `KVCapacityError` naming the
config key, the bytes asked and the bytes free, before torch's allocator is asked (or, if the allocation itself runs
out of memory, instead of torch's error), releases what it had loaded, and under tensor parallelism fails every rank.

The CPU has no free-memory query (`capacity.device_free_bytes` is None there): the tests plant one, or an allocator
that runs out of memory. `tests/gpu/test_kv_pool_memory_gpu.py` asks a real H200 for a pool larger than it.
"""

from __future__ import annotations

import gc
import re
import time
import weakref

import pytest
import torch
import torch.distributed as dist

# The test_tp_startup's helpers: ranks on the CPU (gloo), and a TP engine that starts and generates after a failure.
from test_tp_startup import PROMPT_S, TIMEOUT_S, _a_tp_engine_starts_and_generates, _llm

from prism.distributed import capacity
from prism.distributed.capacity import KVCapacityError
from prism.engine.llm import LLM
from prism.kv.fp8 import KVPool
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.gpu import watch_loaded_models
from prism.testing.tp_faults import dying_follower, failing_swap_pool, live_followers

FREE = 4096  # bytes "free" on the device: less than any pool of the tiny model


@pytest.fixture
def loaded_models(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref]:
    return watch_loaded_models(monkeypatch)


def _failed_start(**config) -> str:
    """The message of the KVCapacityError a start with `config` raises (the error itself is dropped here, so that
    what its traceback held can be collected)."""
    try:
        LLM(ensure_tiny_checkpoint(), device="cpu", page_size=4, **config)
    except KVCapacityError as error:
        return str(error)
    raise AssertionError(f"{config}: the engine started")


def _released(refs: list[weakref.ref]) -> bool:
    gc.collect()
    return bool(refs) and all(r() is None for r in refs)


@pytest.mark.parametrize("config, named", [({"kv_memory_bytes": 2**40}, "kv_memory_bytes=1099511627776"),
                                           ({"num_gpu_pages": 10**6}, "num_gpu_pages=1000000")])
def test_a_pool_beyond_the_free_memory_is_refused_before_its_allocation(monkeypatch, loaded_models, config, named):
    monkeypatch.setattr(capacity, "device_free_bytes", lambda device: FREE)
    asked: list[int] = []
    allocate = KVPool.allocate
    monkeypatch.setattr(KVPool, "allocate", lambda layout, *a, **kw: asked.append(layout.total_bytes)
                        or allocate(layout, *a, **kw))
    message = _failed_start(**config)
    assert named in message, message
    assert f"({FREE} bytes (" in message, f"the message does not name the {FREE} bytes free: {message}"
    asked_bytes = re.search(r"(\d+) bytes \([\d.]+ GiB\) asked", message)
    assert asked_bytes and int(asked_bytes[1]) > FREE, f"the message does not name the bytes asked: {message}"
    assert asked == [], f"the pool went to the allocator: {asked}"
    assert _released(loaded_models), "the failed start kept its model"


def test_an_allocation_out_of_memory_is_the_same_typed_error(monkeypatch, loaded_models):
    """The free memory is a snapshot: the allocation itself may still run out (another process, fragmentation)."""
    def out_of_memory(layout, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (planted)")

    monkeypatch.setattr(KVPool, "allocate", out_of_memory)
    message = _failed_start(kv_memory_bytes=2**20)
    assert "kv_memory_bytes=1048576" in message and "ran out of memory allocating it" in message, message
    assert "Tried to allocate 9.00 GiB (planted)" in message, f"torch's own line is lost: {message}"
    assert _released(loaded_models), "the failed start kept its model"


def test_a_pool_that_fits_starts(monkeypatch):
    """The check refuses only what does not fit: a free memory of exactly the pool's bytes starts."""
    asked: list[int] = []
    allocate = KVPool.allocate
    monkeypatch.setattr(KVPool, "allocate", lambda layout, *a, **kw: asked.append(layout.total_bytes)
                        or allocate(layout, *a, **kw))
    llm = LLM(ensure_tiny_checkpoint(), device="cpu", page_size=4, kv_memory_bytes=2**20)
    need = asked[0]
    llm.engine.shutdown()
    monkeypatch.setattr(capacity, "device_free_bytes", lambda device: need)
    LLM(ensure_tiny_checkpoint(), device="cpu", page_size=4, kv_memory_bytes=2**20).engine.shutdown()
    monkeypatch.setattr(capacity, "device_free_bytes", lambda device: need - 1)
    assert "kv_memory_bytes=1048576" in _failed_start(kv_memory_bytes=2**20)


@pytest.mark.parametrize("fault, why", [("kv_pool_beyond_free_memory", r"cannot hold it \(0 bytes"),
                                        ("kv_pool_allocation_out_of_memory", "ran out of memory allocating it")])
def test_a_pool_that_does_not_fit_on_one_rank_fails_every_rank(fault, why):
    """Rank 1's device cannot hold the pool: rank 0 raises the same typed error (it allocated nothing, or dropped
    its pool), the follower is gone, no group is left, and the process can start another TP engine."""
    torch.set_num_threads(1)
    with dying_follower(fault), pytest.raises(KVCapacityError, match=rf"num_gpu_pages=32 .*2 tensor-parallel .*{why}"):
        _llm(tensor_parallel_size=2)
    assert live_followers() == [], "a follower of the failed start is still running"
    assert not dist.is_initialized(), "the failed start left its group initialized"
    _a_tp_engine_starts_and_generates()


SWAP_PAGES = 7  # num_cpu_pages: no device pool of these tests has 7 pages, so the planted allocator tells them apart


def test_a_swap_pool_the_host_cannot_give_is_the_typed_error_and_keeps_no_pool(monkeypatch, loaded_models):
    """The CPU swap pool is allocated after the device pool: its allocator's out-of-memory is a KVCapacityError
    naming num_cpu_pages, and the device pool allocated before it goes with the failed start."""
    device_pools: list[weakref.ref] = []
    swap_pool_fails = failing_swap_pool(SWAP_PAGES)

    def allocate(layout, *args, **kwargs):
        pool = swap_pool_fails(layout, *args, **kwargs)
        device_pools.append(weakref.ref(pool.payload))
        return pool

    monkeypatch.setattr(KVPool, "allocate", allocate)
    message = _failed_start(num_gpu_pages=32, num_cpu_pages=SWAP_PAGES)
    assert message.startswith("the CPU swap pool does not fit in host memory: num_cpu_pages=7 gives 7 pages"), message
    assert "can't allocate memory" in message, f"the allocator's own line is lost: {message}"
    assert len(device_pools) == 1 and _released(device_pools), "the failed start kept its device pool"
    assert _released(loaded_models), "the failed start kept its model"


def test_a_swap_pool_that_fails_on_one_rank_fails_every_rank_promptly():
    """Rank 1's host cannot give its swap pool: rank 0, which allocated its own, raises the same typed error at once
    (not after distributed_timeout_s in its next collective), the follower is gone and another TP engine starts."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    with dying_follower("swap_pool_allocation_fails"), pytest.raises(
            KVCapacityError, match=r"CPU swap pool .*num_cpu_pages=7 .*2 tensor-parallel .*ran out of memory"):
        _llm(tensor_parallel_size=2, num_cpu_pages=SWAP_PAGES)
    took = time.perf_counter() - started
    assert took < PROMPT_S, f"rank 0 took {took:.1f} s to fail (distributed_timeout_s={TIMEOUT_S})"
    assert live_followers() == [], "a follower of the failed start is still running"
    assert not dist.is_initialized(), "the failed start left its group initialized"
    _a_tp_engine_starts_and_generates()
