"""Which SDPA backends were allowed when a function's attention ran: behind "the eager vision encoder needs no
per-shape attention plan" (`model.attention.plan_free_sdpa`, `model.vision.VisionEncoder.forward`).

cuDNN's attention builds an execution plan for every new shape (~55 ms on the H200), so an eager encoder call
must run with it disabled. Whether it is enabled is a global flag, readable without a GPU: the check runs on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F


def sdpa_backends_per_call(fn: Callable[[], Any]) -> list[tuple[bool, bool]]:
    """For each SDPA call `fn()` made: (cuDNN's attention enabled, flash attention enabled)."""
    sdpa = F.scaled_dot_product_attention
    calls: list[tuple[bool, bool]] = []

    def recorded(*args, **kwargs):
        calls.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return sdpa(*args, **kwargs)

    with mock.patch.object(F, "scaled_dot_product_attention", recorded):
        fn()
    return calls
