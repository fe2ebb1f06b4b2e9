"""Host-to-device copies that never wait for the device.

Owns *no host sync on a step's input path*. A plain `tensor.to("cuda")` from pageable host memory is, in
PyTorch, a copy followed by a stream synchronize: the host waits for every kernel queued before it. After a
vision-encoder graph that was the host waiting 13.5 ms for the encoder (W1 on the H200, session 8) before it
could queue the decoder's first kernel; before a prefix hit's packed step, nine such waits. Staged in pinned
memory and copied non-blocking, the copy is queued behind that work instead and the host goes on (PyTorch's
pinned-memory allocator keeps the staging buffer until the copy has run, so the caller may change its tensor at
once). Every host tensor is staged, pinned or not: asking whether it is pinned costs a driver call.

The staging copy is one `memcpy` on the calling thread (`copy_bytes`), not a torch copy: `Tensor.pin_memory()`
copies with `aten::copy_`, which splits a large tensor over the intra-op thread pool, and on the H200's host that
copy of a 602 KB image frame took 5.4 ms instead of ~0.1 ms in about one cold 8-image request of two, once per
image (W1's engine part 58 -> ~95 ms; stable at 58 with the memcpy). Where the pool's time went was not
established; a parallel copy waits for its slowest thread, and a thread of the pool waiting for a core is enough.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: torch.Tensor | np.ndarray | Sequence[float], device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a host tensor, an array or a list of numbers) on `device` (as `dtype` if given), without waiting
    for the work queued there."""
    host = _host_tensor(values, dtype)
    if dtype is not None:
        host = host.to(dtype)
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return staged_in_pinned_memory(host).to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, values: torch.Tensor | np.ndarray) -> None:
    """`dst[...] = values` (a host tensor or array of dst's shape) without waiting for the work queued on dst's
    device: staged in pinned memory on CUDA (a copy from pageable memory waits for the stream first)."""
    host = _host_tensor(values)
    if dst.device.type != "cuda":
        dst.copy_(host)
        return
    dst.copy_(staged_in_pinned_memory(host), non_blocking=True)


def staged_in_pinned_memory(host: torch.Tensor, pin: bool = True) -> torch.Tensor:
    """A contiguous copy of host tensor `host` in pinned memory (PyTorch's caching host allocator), filled by one
    thread. pin=False: the same in pageable memory, for hosts without a GPU."""
    host = _materialized(host)
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=pin)
    copy_bytes(staged, host)
    return staged


def concatenated_on(tensors: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """The bytes of host tensors `tensors`, one after the other, as one uint8 tensor on `device`: one staging buffer
    and one host-to-device copy for all of them (each tensor's own copy costs the host a few hundred microseconds
    of calls while the device waits)."""
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("concatenated_on joins host tensors")
    device = torch.device(device)
    pin = device.type == "cuda"
    sizes = [t.numel() * t.element_size() for t in tensors]
    staged = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pin)
    offset = 0
    for t, size in zip(tensors, sizes, strict=True):
        copy_bytes(staged[offset : offset + size], _materialized(t).reshape(-1).view(torch.uint8))
        offset += size
    return staged.to(device, non_blocking=True) if pin else staged.to(device)


def _host_tensor(values: torch.Tensor | np.ndarray | Sequence[float], dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` as a tensor (an array's memory shared when it is contiguous; a list made a tensor of `dtype`)."""
    if isinstance(values, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(values))
    if isinstance(values, torch.Tensor):
        return values
    return torch.tensor(values, dtype=dtype)


def _materialized(host: torch.Tensor) -> torch.Tensor:
    """`host` as contiguous plain values, the bytes a memcpy may take. A non-contiguous (or lazily conjugated /
    negated) tensor is materialized by torch, a second copy: no caller on a hot path passes one."""
    return host.resolve_conj().resolve_neg().contiguous()


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst[...] = src` for two contiguous host tensors of one dtype and shape, as a single-threaded `memcpy`
    (numpy's, which releases the GIL) over their bytes, whatever the dtype."""
    if dst.dtype != src.dtype or dst.shape != src.shape or not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError(f"copy_bytes needs two contiguous tensors of one dtype and shape, got {src.dtype} "
                         f"{tuple(src.shape)} -> {dst.dtype} {tuple(dst.shape)}")
    if src.numel():
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
