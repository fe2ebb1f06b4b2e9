"""Residual add + LayerNorm of the vision encoder in one pass, beside its torch reference.

Owns: `x = residual + delta` (rounded to the activation dtype, as HF's `hidden_states + ...`) followed by
LayerNorm of that sum (fp32 statistics, `(x - mean) * rstd * weight + bias` in fp32, one rounding: what
`torch.nn.LayerNorm` computes), in one launch on CUDA. The reference is the two torch ops. Only the order
of the mean's and variance's sums differs (torch uses Welford), so the two agree to about one ulp of the
activation dtype. Each row is computed by its own program: no result depends on the batch.

Why: every vision block adds a residual and normalizes twice; at 6,272 patches (W1's eight 448x448 images)
the adds (~10 us) and norms (~18 us) were separate memory passes, ~1.6 ms of the encoder's ~15.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_write import HAVE_TRITON, _want_triton, device_context

if HAVE_TRITON:
    import triton
    import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def add_layer_norm_reference(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(residual + delta), residual + delta): the sum rounded to the activation dtype first."""
    summed = residual + delta
    return F.layer_norm(summed, (summed.shape[-1],), weight, bias, eps), summed


if HAVE_TRITON:
    from .fused_norms import _TL_DTYPE

    @triton.jit
    def _add_layer_norm_kernel(d_ptr, r_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, stride_d, stride_r, stride_o,
                               stride_s, D, eps, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        delta = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
        res = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (delta + res).to(DTYPE)  # the norm sees the rounded sum, as the reference does
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
        x = x.to(tl.float32)
        mean = tl.sum(x, axis=0) / D
        centered = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(centered * centered, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (centered * rstd * w + b).to(DTYPE), mask=mask)


def add_layer_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float, *, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(residual + delta), residual + delta) over the last dim of 2-D [rows, D] tensors of one float
    dtype; one launch on CUDA instead of an add kernel and a norm kernel."""
    if delta.shape != residual.shape or delta.dim() != 2:
        raise ValueError(f"add_layer_norm: delta {tuple(delta.shape)} and residual {tuple(residual.shape)} "
                         "must be the same [rows, D]")
    if weight.shape != (delta.shape[1],) or bias.shape != (delta.shape[1],):
        raise ValueError(f"add_layer_norm: weight {tuple(weight.shape)} / bias {tuple(bias.shape)} do not "
                         f"match D = {delta.shape[1]}")
    if delta.dtype != residual.dtype or delta.dtype not in _DTYPES:
        raise ValueError(f"add_layer_norm: delta and residual must share one of {_DTYPES}, got {delta.dtype} and "
                         f"{residual.dtype}")
    if not _want_triton(delta.device, use_triton) or delta.numel() == 0:
        return add_layer_norm_reference(delta, residual, weight, bias, eps)
    delta, residual, weight, bias = (t if t.stride(-1) == 1 else t.contiguous() for t in (delta, residual, weight, bias))
    out = torch.empty(delta.shape, dtype=delta.dtype, device=delta.device)
    summed = torch.empty_like(out)
    d = delta.shape[1]
    block = triton.next_power_of_2(d)
    with device_context(delta.device):
        _add_layer_norm_kernel[(delta.shape[0],)](
            delta, residual, weight, bias, out, summed, delta.stride(0), residual.stride(0), out.stride(0),
            summed.stride(0), d, eps, DTYPE=_TL_DTYPE[delta.dtype], BLOCK=block,
            num_warps=max(1, min(16, block // 256)))
    return out, summed
