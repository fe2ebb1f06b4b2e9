"""Tensor-parallel start-up: every rank has a device.

A `tensor_parallel_size` the host's CUDA devices cannot hold is a `ConfigError` naming the setting, the number
asked and the devices there are, raised before anything is spawned or loaded (the CPU's ranks are processes over
gloo and need no device).
"""

from __future__ import annotations

import time

import pytest
import torch

from prism.engine.config import ConfigError, EngineConfig
from prism.engine.engine import Engine
from prism.engine.rank import check_rank_devices, rank_device
from prism.testing.checkpoints import ensure_tiny_checkpoint


@pytest.mark.parametrize("device, devices", [("cuda", 1), ("cuda:0", 1), ("cuda:1", 2), ("cuda", 0)])
def test_more_ranks_than_cuda_devices_is_a_config_error_before_anything_starts(monkeypatch, device, devices):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"tensor_parallel_size=2 needs 2 CUDA devices .*{device!r}.* {devices} "):
        Engine(ensure_tiny_checkpoint(), EngineConfig(tensor_parallel_size=2, device=device))
    assert time.perf_counter() - started < 2, "the check must come before any rank starts or loads"


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
