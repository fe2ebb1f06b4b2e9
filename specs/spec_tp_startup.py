"""Spec of tensor-parallel start-up, on the real code: every rank has a device.

Devices (`engine/rank.py`): for any device setting, tensor_parallel_size and count of CUDA devices, either every
rank runs on a device of its own that exists, rank 0 on the configured one, or `check_rank_devices` refuses the
config with a ConfigError naming the setting, the number asked and the devices there are; ranks on the CPU are
never refused.
"""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.engine import rank
from prism.engine.config import ConfigError, EngineConfig

DEVICES = st.sampled_from(["cpu", "auto", "cuda"]) | st.integers(0, 7).map(lambda i: f"cuda:{i}")


@settings(max_examples=300, report_multiple_bugs=False)
@given(device=DEVICES, tp=st.integers(1, 8), count=st.integers(0, 8))
def spec_every_rank_has_its_own_device_or_the_config_is_refused(device: str, tp: int, count: int) -> None:
    config = EngineConfig(device=device, tensor_parallel_size=tp)
    with mock.patch.object(torch.cuda, "device_count", lambda: count), \
            mock.patch.object(torch.cuda, "is_available", lambda: count > 0):
        configured = config.resolved_device()
        try:
            rank.check_rank_devices(config)
            refused = None
        except Exception as error:  # noqa: BLE001 - what else it raises is the counterexample
            refused = error
        devices = [rank.rank_device(config, r) for r in range(tp)]
    case = f"device={device!r}, tensor_parallel_size={tp}, {count} CUDA device(s)"
    if refused is not None:
        assert isinstance(refused, ConfigError), f"{case}: refused with {refused!r}, not a ConfigError"
        message = str(refused)
        assert f"tensor_parallel_size={tp}" in message and f" {count} " in message, (
            f"{case}: the refusal must name the setting, the number asked and the devices there are: {message}")
        assert configured.type == "cuda" and tp > 1, f"{case}: refused, though {message}"
        return
    assert devices[0].type == configured.type and (devices[0].index or 0) == (configured.index or 0), (
        f"{case}: rank 0 runs on {devices[0]}, not the configured {configured}")
    if configured.type == "cuda" and tp > 1:
        indices = [d.index for d in devices]
        assert len(set(indices)) == tp, f"{case}: ranks share a device: {devices}"
        assert all(i is not None and 0 <= i < count for i in indices), f"{case}: a rank's device is missing: {devices}"
