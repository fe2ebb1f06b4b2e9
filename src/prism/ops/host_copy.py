"""Host-to-device copies that never wait for the device.

Owns *no host sync on a step's input path*. A plain `tensor.to("cuda")` from pageable host memory is, in
PyTorch, a copy followed by a stream synchronize: the host waits for every kernel queued before it. After a
vision-encoder graph that was the host waiting 13.5 ms for the encoder (W1 on the H200, session 8) before it
could queue the decoder's first kernel; before a prefix hit's packed step, nine such waits. Staged in pinned
memory and copied non-blocking, the copy is queued behind that work instead and the host goes on (PyTorch's
pinned-memory allocator keeps the staging buffer until the copy has run). A tensor already pinned is not staged
again: its caller must leave it unchanged until the copy has run (the CUDA graphs' row buffers are double-buffered
for that reason).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: torch.Tensor | np.ndarray | Sequence[float], device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a host tensor, an array or a list of numbers) on `device` (as `dtype` if given), without waiting
    for the work queued there."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(values))
    elif isinstance(values, torch.Tensor):
        host = values
    else:
        host = torch.tensor(values, dtype=dtype)
    if dtype is not None:
        host = host.to(dtype)
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.contiguous().pin_memory().to(device, non_blocking=True)
