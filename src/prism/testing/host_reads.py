"""Which torch ops of a function read a tensor that lives on the host: what a CUDA graph capture cannot hold.

Owns the check behind "the vision encoder's device work is capturable" (`engine/vision_graphs.py`): a capture
records device work only, so an op that copies a host tensor to the device inside it fails the capture (the first
version of the vision graphs did, computing the grid metadata inside the captured call, on the H200). Run on the
`meta` device, the check needs no GPU: every op whose arguments include a host tensor of one or more dimensions
is reported (0-dimensional host tensors are scalars, passed by value).

Also behind "a host tensor is staged for the device by one thread" (`ops/host_copy.py`): `host_copies` reports
the torch ops that copied host tensor data, which run over the intra-op thread pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() > 0 for a in flat):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def host_tensor_reads(fn: Callable[[], Any]) -> list[str]:
    """The ops `fn()` ran with a host tensor among their arguments, in order."""
    with _HostReads() as mode:
        fn()
    return mode.ops


_COPY_OPS = ("copy_", "clone", "_to_copy", "_pin_memory")


def host_copies(fn: Callable[[], Any]) -> list[str]:
    """The ops `fn()` ran that copy a host tensor's data (torch's copies, split over the intra-op pool)."""
    return [op for op in host_tensor_reads(fn) if op.split(".")[1] in _COPY_OPS]
