"""The attention interface of the decoder and the dense reference implementations.

Owns: the `AttentionBackend` contract. The decoder computes q/k/v for the packed tokens of one step
(after Q/K RMSNorm and M-RoPE) and hands them, with the layer index, to a backend object built for
that step; the backend owns the batch layout (sequence boundaries, and for a cached backend the KV
pages and context lengths) and returns the attention output. `DenseCausalAttention` is the plain
reference (causal within each packed sequence, no cache) used by the parity tests.
`dense_varlen_attention` is the shared kernel-free core, also used non-causally by the vision encoder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# SDPA backends that need no setup per shape, each with the flag that says whether it is enabled now. cuDNN's
# attention, PyTorch's first choice on Hopper, builds an execution plan the first time it sees a shape: 54-59 ms
# on the H200 for the vision encoder's [n images, 16 heads, 784 patches, 72] (torch 2.11, session 10), against
# ~0.2 ms for flash attention's first call. The vision encoder's shapes follow the image sizes and counts of each
# request, so most of them are new; see `VisionEncoder.forward`.
_PLAN_FREE_SDPA = (
    (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled),
    (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled),
    (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled),
)


def plan_free_sdpa() -> contextlib.AbstractContextManager:
    """A context in which SDPA chooses among the backends enabled now, cuDNN's left out (all of them when only
    cuDNN's is enabled: the caller's setting wins). PyTorch's backend flags are process-wide, not per thread: this
    relies on the engine running its model on one thread (the server's engine thread; TP ranks are processes)."""
    enabled = [backend for backend, is_enabled in _PLAN_FREE_SDPA if is_enabled()]
    return sdpa_kernel(enabled) if enabled else contextlib.nullcontext()


@runtime_checkable
class AttentionBackend(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention for the packed tokens of this step.

        q: [N, num_heads, head_dim]; k, v: [N, num_kv_heads, head_dim] (the new tokens' K/V, rotated).
        Returns [N, num_heads, head_dim] in q's dtype. A cached backend stores k/v for `layer_idx`
        and attends over the cached context plus these tokens.
        """
        ...


def seq_lens_from_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int]) -> tuple[int, ...]:
    """Host sequence lengths from cumulative offsets [B+1] (one device sync if on device)."""
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
    return tuple(int(b - a) for a, b in zip(cu, cu[1:], strict=False))


def _runs(seq_lens: Sequence[int]) -> list[tuple[int, int]]:
    """Group consecutive equal lengths: [(length, count)], so equal segments share one SDPA call."""
    runs: list[tuple[int, int]] = []
    for n in seq_lens:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return runs


def dense_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: Sequence[int],
    *,
    causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention restricted to each packed segment. q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D].

    Segment lengths are host ints, so this issues no device sync; runs of equal-length segments
    (e.g. same-size images) are batched into one SDPA call. GQA is native (no K/V head copies).
    """
    n = q.shape[0]
    if sum(seq_lens) != n or k.shape[0] != n or v.shape[0] != n:
        raise ValueError(
            f"segments sum to {sum(seq_lens)} but q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows"
        )
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    start = 0
    for length, count in _runs(seq_lens):
        if length == 0:
            continue
        end = start + length * count
        # [count, L, H, D] -> [count, H, L, D]
        qs, ks, vs = (t[start:end].unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=gqa)
        out[start:end] = o.transpose(1, 2).flatten(0, 1)
        start = end
    return out


class DenseCausalAttention:
    """Reference decoder backend: causal attention inside each packed sequence of this step, no KV cache."""

    def __init__(self, seq_lens: Sequence[int], scale: float | None = None):
        if any(int(n) < 0 for n in seq_lens):
            raise ValueError(f"negative sequence length in {list(seq_lens)}")
        self.seq_lens = tuple(int(n) for n in seq_lens)
        self.scale = scale

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: torch.Tensor | Sequence[int], scale: float | None = None
    ) -> DenseCausalAttention:
        return cls(seq_lens_from_cu_seqlens(cu_seqlens), scale)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_varlen_attention(q, k, v, self.seq_lens, causal=True, scale=self.scale)
