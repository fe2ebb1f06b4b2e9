"""A KV pool larger than the GPU (tiny checkpoint, one GPU): the start refuses it with a `KVCapacityError` naming the
key, the bytes asked and the bytes free, before torch's allocator is asked; an allocation that runs out of memory all
the same (the free memory claimed unlimited here) is the same typed error, from torch's real `OutOfMemoryError`; and
the failed start gives back what it allocated (its model, its pool)."""

from __future__ import annotations

import re
import weakref

import pytest
import torch

from prism.distributed import capacity
from prism.distributed.capacity import KVCapacityError
from prism.engine.llm import LLM
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.gpu import release_gpu_memory, watch_loaded_models

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def loaded_models(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref]:
    return watch_loaded_models(monkeypatch)


def _failed_start(**config) -> str:
    """The message of the KVCapacityError (dropped here, so that what its traceback held can be collected)."""
    try:
        LLM(ensure_tiny_checkpoint(), device="cuda", **config)
    except KVCapacityError as error:
        return str(error)
    raise AssertionError(f"{config}: the engine started")


def _gives_back(refs: list[weakref.ref], allocated_before: int) -> None:
    release_gpu_memory()
    assert refs and all(r() is None for r in refs), "the failed start kept its model"
    left = torch.cuda.memory_allocated() - allocated_before
    assert left <= 2**20, f"the failed start left {left} bytes allocated on the device"


@pytest.mark.parametrize("key", ["kv_memory_bytes", "num_gpu_pages"])
def test_a_pool_larger_than_the_device_is_refused_naming_the_numbers(loaded_models, key):
    release_gpu_memory()
    before = torch.cuda.memory_allocated()
    _, total = torch.cuda.mem_get_info()
    value = 2 * total if key == "kv_memory_bytes" else 10**9  # pages of 16 tokens: far beyond the device
    message = _failed_start(**{key: value})
    assert f"{key}={value}" in message and "cannot hold it" in message, message
    asked = re.search(r"(\d+) bytes \([\d.]+ GiB\) asked", message)
    free = re.search(r"\((\d+) bytes \([\d.]+ GiB\) free after the model's weights\)", message)
    assert asked and free, f"the message names neither the bytes asked nor the bytes free: {message}"
    assert int(free[1]) < total < int(asked[1]), message
    _gives_back(loaded_models, before)


def test_a_pool_of_the_whole_device_is_refused(loaded_models):
    """What the weights and the CUDA context take is not free: a pool of the device's whole memory does not fit."""
    release_gpu_memory()
    before = torch.cuda.memory_allocated()
    _, total = torch.cuda.mem_get_info()
    assert f"kv_memory_bytes={total}" in _failed_start(kv_memory_bytes=total)
    _gives_back(loaded_models, before)


def test_the_allocation_running_out_of_memory_is_the_same_typed_error(monkeypatch, loaded_models):
    release_gpu_memory()
    before = torch.cuda.memory_allocated()
    monkeypatch.setattr(capacity, "device_free_bytes", lambda device: capacity.UNKNOWN_FREE - 1)
    _, total = torch.cuda.mem_get_info()
    message = _failed_start(kv_memory_bytes=2 * total)
    assert f"kv_memory_bytes={2 * total}" in message and "ran out of memory allocating it" in message, message
    assert "(the allocator: " in message, f"torch's own line is lost: {message}"
    _gives_back(loaded_models, before)


def test_a_pool_that_fits_still_starts():
    llm = LLM(ensure_tiny_checkpoint(), device="cuda", kv_memory_bytes=2**30)
    try:
        assert llm.engine.runner.gpu_pool.layout.num_pages >= llm.engine.runner.layout.num_pages > 0
    finally:
        llm.engine.shutdown()
        del llm
        release_gpu_memory()


def test_a_pinned_swap_pool_larger_than_the_host_is_the_same_typed_error(loaded_models):
    """The CPU swap pool is pinned on CUDA: a pinned allocation past the host's memory is CUDA's "out of memory"
    RuntimeError, not torch's OutOfMemoryError. `capacity` counts that line as out of memory: the start is a
    KVCapacityError naming `num_cpu_pages` (unchecked on a GPU until this test)."""
    release_gpu_memory()
    before = torch.cuda.memory_allocated()
    pages = 10**9  # terabytes of pages of the tiny model: past any host
    message = _failed_start(kv_memory_bytes=2**30, num_cpu_pages=pages)
    assert f"num_cpu_pages={pages}" in message and "CPU swap pool" in message, message
    assert "ran out of memory allocating it" in message and "(the allocator: " in message, message
    _gives_back(loaded_models, before)
