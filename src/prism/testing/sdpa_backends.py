"""Which SDPA backends were allowed when a function's attention ran: behind "the eager vision encoder needs no
per-shape attention plan" (`model.attention.PLAN_FREE_SDPA`, `model.vision.VisionEncoder.forward`).

cuDNN's attention builds an execution plan for every new shape (~55 ms on the H200), so an eager encoder call
must run with it disabled. Whether it is enabled is a global flag, readable without a GPU: the check runs on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F


def sdpa_calls_with_cudnn(fn: Callable[[], Any]) -> tuple[int, int]:
    """(SDPA calls `fn()` made, how many of them with cuDNN's attention enabled)."""
    sdpa = F.scaled_dot_product_attention
    calls = [0, 0]

    def recorded(*args, **kwargs):
        calls[0] += 1
        calls[1] += int(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    with mock.patch.object(F, "scaled_dot_product_attention", recorded):
        fn()
    return calls[0], calls[1]
