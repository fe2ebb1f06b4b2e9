"""Tensor-parallel start-up: devices and dying followers.

A `tensor_parallel_size` the host's CUDA devices cannot hold is a `ConfigError` naming the setting, the number
asked and the devices there are, raised before anything is spawned or loaded (the CPU's ranks are processes over
gloo and need no device). A follower that dies while the ranks start (before it joins the group, or while it
loads its model; killed or raising) fails rank 0 at once with a `TensorParallelFailure` naming the rank and its
exit code, instead of after `distributed_timeout_s`; the other followers are stopped and nothing is left behind
(a TP engine starts in the same process after it). Ranks are processes on the CPU (gloo); the faults are planted
in rank 1 (`prism.testing.tp_faults`).
"""

from __future__ import annotations

import gc
import re
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from prism.engine.config import ConfigError, EngineConfig
from prism.engine.engine import Engine
from prism.engine.llm import LLM
from prism.engine.rank import check_rank_devices, rank_device
from prism.engine.sampling import SamplingParams
from prism.engine.tp_workers import TensorParallelFailure
from prism.kv.fp8 import KVPool
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.gpu import watch_loaded_models
from prism.testing.tp_faults import WARM_UP_FAILED, dying_follower, live_followers

TIMEOUT_S = 30.0  # distributed_timeout_s: the start-up waited all of it for a follower that died before joining
PROMPT_S = 15.0  # ... rank 0 must fail well before it (spawning and loading a tiny model take a few seconds)


def _llm(**config) -> LLM:
    """Ranks on the CPU (gloo) whatever the host's GPUs."""
    return LLM(ensure_tiny_checkpoint(), device="cpu", num_gpu_pages=32, page_size=4, kv_dtype="fp8",
               max_num_batched_tokens=160, distributed_timeout_s=TIMEOUT_S, **config)


@pytest.mark.parametrize("device, devices", [("cuda", 1), ("cuda:0", 1), ("cuda:1", 2), ("cuda", 0)])
def test_more_ranks_than_cuda_devices_is_a_config_error_before_anything_starts(monkeypatch, device, devices):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"tensor_parallel_size=2 needs 2 CUDA devices .*{device!r}.* {devices} "):
        Engine(ensure_tiny_checkpoint(), EngineConfig(tensor_parallel_size=2, device=device))
    assert time.perf_counter() - started < 2, "the check must come before any rank starts or loads"
    assert live_followers() == []


def test_ranks_take_the_cuda_devices_from_the_configured_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    for device, first in (("cuda", 0), ("cuda:0", 0), ("cuda:1", 1)):
        config = EngineConfig(tensor_parallel_size=2, device=device)
        check_rank_devices(config)
        assert [rank_device(config, r) for r in range(2)] == [torch.device("cuda", first + r) for r in range(2)]
    with pytest.raises(ConfigError, match="cuda:2 to cuda:3"):
        check_rank_devices(EngineConfig(tensor_parallel_size=2, device="cuda:2"))


def test_cpu_ranks_need_no_device(monkeypatch):
    """How the tests run TP: ranks are processes of this host over gloo, whatever its CUDA devices."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cpu", "auto"):
        config = EngineConfig(tensor_parallel_size=4, device=device)
        check_rank_devices(config)
        assert {rank_device(config, r) for r in range(4)} == {torch.device("cpu")}


def _a_tp_engine_starts_and_generates() -> None:
    """After a failed start: the process can start another TP engine, which generates."""
    llm = _llm(tensor_parallel_size=2)
    try:
        (out,) = llm.generate(["Hello there"], SamplingParams.greedy(max_tokens=2, ignore_eos=True))
        assert len(out.token_ids) == 2
    finally:
        llm.engine.shutdown()


def test_a_follower_killed_before_joining_fails_rank_0_at_once_and_leaves_nothing():
    """Rank 2 of 3 waits at the rendezvous for rank 1, which was killed before it got there: rank 0 names rank 1,
    rank 2 is stopped, and the process can start another TP engine."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    with dying_follower("killed_before_joining"), \
            pytest.raises(TensorParallelFailure, match=r"rank 1 exited with code -9 \(SIGKILL\).*join"):
        _llm(tensor_parallel_size=3)
    took = time.perf_counter() - started
    assert took < PROMPT_S, f"rank 0 took {took:.1f} s to fail (distributed_timeout_s={TIMEOUT_S})"
    assert live_followers() == [], "a follower of the failed start is still running"
    _a_tp_engine_starts_and_generates()


@pytest.mark.parametrize("fault, named", [
    ("raises_while_loading", "rank 1 failed: RuntimeError: planted: rank 1 could not load its model"),  # its error
    ("killed_while_loading", r"rank 1 exited with code -9 \(SIGKILL\)"),
])
def test_a_follower_dying_while_it_loads_fails_rank_0_naming_it(fault, named):
    torch.set_num_threads(1)
    started = time.perf_counter()
    with dying_follower(fault), \
            pytest.raises(TensorParallelFailure, match=rf"{named} .*before every rank loaded its model"):
        _llm(tensor_parallel_size=2)
    took = time.perf_counter() - started
    assert took < PROMPT_S, f"rank 0 took {took:.1f} s to fail (distributed_timeout_s={TIMEOUT_S})"
    assert live_followers() == []


def test_a_start_failing_after_the_group_formed_leaves_no_group(monkeypatch):
    """The review of session 29: a failure after the default group formed (here the step channel's side group; on
    NCCL, gloo's connect waiting for a follower that died after joining) left the group initialized, and every later
    TP engine in the process failed with "already initialized". The failed start now aborts it."""
    import torch.distributed as dist

    from prism.engine import tp_workers

    torch.set_num_threads(1)

    def no_channel(group):
        raise RuntimeError("planted: the step channel could not be opened")

    monkeypatch.setattr(tp_workers, "StepChannel", no_channel)
    with pytest.raises(TensorParallelFailure, match="planted"):
        _llm(tensor_parallel_size=2)
    assert not dist.is_initialized(), "the failed start left its group initialized"
    assert live_followers() == []
    monkeypatch.undo()
    _a_tp_engine_starts_and_generates()


@pytest.mark.parametrize("fault, named", [
    ("killed_after_the_kv_pools", r"rank 1 exited with code -9 \(SIGKILL\) before every rank finished its start"),
    ("raises_while_warming_up", rf"rank 1 failed: RuntimeError: {re.escape(WARM_UP_FAILED)}.* finished its start"),
])
def test_a_follower_failing_after_its_kv_pools_fails_rank_0s_start_and_leaves_nothing(monkeypatch, fault, named):
    """Session 30: rank 0's start returned an engine whose follower had died after its KV pools (on the CPU the
    pools' agreement is a rank's last collective; nothing watched the followers until the first step). Every rank
    now ends its start reporting READY, rank 0 waits for every follower's report watching their exits and the
    errors they report: the start fails at once, naming rank 1's exit or its error, with nothing left behind (rank
    0's pools not even while the error lives, as a failed pool agreement's). On the CPU rank 1's graph capture (its
    warm-up on CUDA) runs with `graph_rows_without_cuda`."""
    torch.set_num_threads(1)
    models = watch_loaded_models(monkeypatch)
    pools: list[weakref.ref] = []  # rank 0's (this process's)
    allocate = KVPool.allocate
    monkeypatch.setattr(KVPool, "allocate", lambda *args, **kwargs: _watched(pools, allocate(*args, **kwargs)))
    started = time.perf_counter()
    with dying_follower(fault), pytest.raises(TensorParallelFailure, match=named) as failed:
        _llm(tensor_parallel_size=2, graph_rows_without_cuda=True)
    took = time.perf_counter() - started
    assert took < PROMPT_S, f"rank 0 took {took:.1f} s to fail (distributed_timeout_s={TIMEOUT_S})"
    assert live_followers() == [], "a follower of the failed start is still running"
    assert not dist.is_initialized(), "the failed start left its group initialized"
    gc.collect()
    assert pools and all(r() is None for r in pools), "rank 0's KV pool outlived the failed start"
    del failed
    gc.collect()
    assert models and all(r() is None for r in models), "the failed start kept rank 0's model"
    monkeypatch.undo()
    _a_tp_engine_starts_and_generates()


def _watched(refs: list[weakref.ref], pool):
    refs.append(weakref.ref(pool.payload))
    return pool
