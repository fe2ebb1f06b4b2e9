"""Fused element-wise ops of the text decoder: RMSNorm, residual add + RMSNorm, per-head Q/K RMSNorm +
M-RoPE, SiLU-and-mul.

Owns: doing each op in ONE launch on CUDA with the same arithmetic, rounding step by rounding step, as
the torch reference beside it (which is HF's op order: RMSNorm in fp32, cast, then times the weight in the
activation dtype; rope as x*cos + rotate_half(x)*sin, each product rounded). Only the order of the
mean's sum differs, so results agree to about one ulp of the activation dtype. Every row is computed by
its own program from its own inputs: the result of a row never depends on the batch (deterministic mode
relies on this).

Why: a decode step of the 8B model ran ~40 tiny torch kernels per layer around 4 GEMMs; in a CUDA graph
their launch gaps, not their bytes, cost ~2.5 ms per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_write import HAVE_TRITON, _want_triton, device_context
from .pdl import launch_options

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import wait_for_predecessors


# ------------------------------------------------------------------------------------------- references
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm over the last dim: fp32 normalize, cast back, times the weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's `residual + x` (rounded to the activation dtype), then RMSNorm of that sum: (normed, sum)."""
    summed = residual + x
    return rms_norm_reference(summed, weight, eps), summed


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos/sin [N, D] (the halves repeated, as HF builds them)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k [N, Hkv, D] (any strides) -> per-head RMSNorm then rope, each [N, H, D] contiguous."""
    return (apply_rope_reference(rms_norm_reference(q, q_weight, eps), cos, sin),
            apply_rope_reference(rms_norm_reference(k, k_weight, eps), cos, sin))


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] as [gate | up] -> silu(gate) * up, [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------------------------- Triton
if HAVE_TRITON:

    @triton.jit
    def _round(x, DTYPE: tl.constexpr):
        """Round fp32 `x` to the activation dtype and back: one rounding step of the reference."""
        return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def _normed_row(x_ptr, w_ptr, cols, mask, D, eps, DTYPE: tl.constexpr):
        x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        return _normed(x, w_ptr, cols, mask, D, eps, DTYPE)

    @triton.jit
    def _normed(x, w_ptr, cols, mask, D, eps, DTYPE: tl.constexpr):
        """RMSNorm of one row already in registers (fp32 holding activation-dtype values)."""
        var = tl.sum(x * x, axis=0) / D
        h = _round(x / tl.sqrt_rn(var + eps), DTYPE)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        return _round(h * w, DTYPE)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, D, eps,
                         DTYPE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_predecessors(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        y = _normed_row(x_ptr + row * stride_x, w_ptr, cols, mask, D, eps, DTYPE)
        tl.store(out_ptr + row * stride_o + cols, y.to(DTYPE), mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, D,
                             eps, DTYPE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_predecessors(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = _round(x + r, DTYPE)  # the norm sees the rounded sum, as the reference does
        tl.store(sum_ptr + row * stride_s + cols, summed.to(DTYPE), mask=mask)
        y = _normed(summed, w_ptr, cols, mask, D, eps, DTYPE)
        tl.store(out_ptr + row * stride_o + cols, y.to(DTYPE), mask=mask)

    @triton.jit
    def _norm_rope_heads(src, stride_h, w_ptr, cos_ptr, sin_ptr, dst, num_heads, eps,
                         HALF: tl.constexpr, BLOCK_H: tl.constexpr, DTYPE: tl.constexpr):
        """Every head of one token: [BLOCK_H, HALF] halves, per-head RMSNorm, then rope, stored contiguous."""
        o1, o2, h, j = norm_rope_values(src, stride_h, w_ptr, cos_ptr, sin_ptr, num_heads, eps, HALF, BLOCK_H, DTYPE)
        hmask = (h < num_heads)[:, None]
        out = dst + h[:, None].to(tl.int64) * (2 * HALF)
        tl.store(out + j[None, :], o1.to(DTYPE), mask=hmask)
        tl.store(out + HALF + j[None, :], o2.to(DTYPE), mask=hmask)

    @triton.jit
    def norm_rope_values(src, stride_h, w_ptr, cos_ptr, sin_ptr, num_heads, eps,
                         HALF: tl.constexpr, BLOCK_H: tl.constexpr, DTYPE: tl.constexpr):
        """Every head of one token, normed and rotated, in registers: (first halves, second halves) [BLOCK_H,
        HALF] in fp32 holding activation-dtype values (what `_norm_rope_heads` stores), head and column ids."""
        h = tl.arange(0, BLOCK_H)
        j = tl.arange(0, HALF)
        hmask = (h < num_heads)[:, None]
        rows = src + h[:, None].to(tl.int64) * stride_h
        x1 = tl.load(rows + j[None, :], mask=hmask, other=0.0).to(tl.float32)
        x2 = tl.load(rows + HALF + j[None, :], mask=hmask, other=0.0).to(tl.float32)
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        inv = (1.0 / tl.sqrt_rn(var + eps))[:, None]
        w1 = tl.load(w_ptr + j).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j).to(tl.float32)[None, :]
        n1 = _round(_round(x1 * inv, DTYPE) * w1, DTYPE)
        n2 = _round(_round(x2 * inv, DTYPE) * w2, DTYPE)
        c1 = tl.load(cos_ptr + j).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + HALF + j).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + j).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + HALF + j).to(tl.float32)[None, :]
        o1 = _round(_round(n1 * c1, DTYPE) + _round(-n2 * s1, DTYPE), DTYPE)
        o2 = _round(_round(n2 * c2, DTYPE) + _round(n1 * s2, DTYPE), DTYPE)
        return o1, o2, h, j

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, HQ, HKV, eps,
                             HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                             DTYPE: tl.constexpr):
        # grid = (tokens, 2): all query heads of a token (axis 1 = 0) or all its KV heads (1).
        t = tl.program_id(0).to(tl.int64)
        cos_row, sin_row = cos_ptr + t * stride_cs, sin_ptr + t * stride_cs
        if tl.program_id(1) == 0:
            _norm_rope_heads(q_ptr + t * stride_qt, stride_qh, qw_ptr, cos_row, sin_row, qo_ptr + t * HQ * 2 * HALF,
                             HQ, eps, HALF, BLOCK_HQ, DTYPE)
        else:
            _norm_rope_heads(k_ptr + t * stride_kt, stride_kh, kw_ptr, cos_row, sin_row, ko_ptr + t * HKV * 2 * HALF,
                             HKV, eps, HALF, BLOCK_HKV, DTYPE)

    @triton.jit
    def _silu_times(g, u, DTYPE: tl.constexpr):
        """silu(g) * u in fp32 for a gate g and an up u already rounded to the activation dtype: the silu rounded,
        then the product rounded, as HF's ops in that dtype round them (every fused gate/up kernel's epilogue)."""
        return _round(_round(g / (1.0 + tl.exp(-g)), DTYPE) * u, DTYPE)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, INTER, BLOCK: tl.constexpr,
                             DTYPE: tl.constexpr, PDL: tl.constexpr):
        # grid = (tokens, column blocks)
        wait_for_predecessors(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < INTER
        g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, _silu_times(g, u, DTYPE).to(DTYPE), mask=mask)

    _TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, D] with a unit last stride, without copying when it already is one."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: bool | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape); one launch on CUDA."""
    if not _want_triton(x.device, use_triton) or x.numel() == 0:
        return rms_norm_reference(x, weight, eps)
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    d = rows.shape[1]
    block = triton.next_power_of_2(d)
    with device_context(x.device):
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), d, eps,
                                           DTYPE=_TL_DTYPE[x.dtype], BLOCK=block,
                                           num_warps=max(1, min(16, block // 256)), **launch_options(x.device))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x) over the last dim; one launch on CUDA instead of an add kernel
    and a norm kernel (two per decoder layer, each a node of the decode graph)."""
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    if not _want_triton(x.device, use_triton) or x.numel() == 0:
        return add_rms_norm_reference(x, residual, weight, eps)
    xs, rs = _rows(x), _rows(residual)
    out = torch.empty(xs.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(xs.shape, dtype=x.dtype, device=x.device)
    d = xs.shape[1]
    block = triton.next_power_of_2(d)
    with device_context(x.device):
        _add_rms_norm_kernel[(xs.shape[0],)](xs, rs, weight, out, summed, xs.stride(0), rs.stride(0),
                                             out.stride(0), summed.stride(0), d, eps,
                                             DTYPE=_TL_DTYPE[x.dtype], BLOCK=block,
                                             num_warps=max(1, min(16, block // 256)), **launch_options(x.device))
    return out.view(x.shape), summed.view(x.shape)


def check_rope_heads(op: str, *heads: torch.Tensor) -> None:
    """The Triton norm/rope kernels read [N, H, D] heads with unit stride along D, in halves of a power-of-two size."""
    d = heads[0].shape[2]
    if any(t.stride(2) != 1 for t in heads) or d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"{op} needs unit-stride heads of a power-of-two half dim, got D={d}")


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, *, use_triton: bool | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm then rope of q [N, Hq, D] and k [N, Hkv, D] (views of the fused qkv output are
    fine: the head dim must be unit-stride); one launch on CUDA."""
    if not _want_triton(q.device, use_triton) or q.shape[0] == 0:
        return qk_norm_rope_reference(q, k, q_weight, k_weight, eps, cos, sin)
    n, hq, d = q.shape
    hkv = k.shape[1]
    check_rope_heads("qk_norm_rope", q, k)
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, hkv, d), dtype=k.dtype, device=k.device)
    with device_context(q.device):
        _qk_norm_rope_kernel[(n, 2)](q, k, q_weight, k_weight, cos, sin, q_out, k_out,
                                     q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
                                     hq, hkv, eps, HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq),
                                     BLOCK_HKV=triton.next_power_of_2(hkv), DTYPE=_TL_DTYPE[q.dtype], num_warps=4)
    return q_out, k_out


def silu_and_mul(gate_up: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """[N, 2I] as [gate | up] -> silu(gate) * up [N, I]; one launch on CUDA."""
    if not _want_triton(gate_up.device, use_triton) or gate_up.numel() == 0:
        return silu_and_mul_reference(gate_up)
    rows = _rows(gate_up)
    inter = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    with device_context(gate_up.device):
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, out, rows.stride(0), out.stride(0), inter, BLOCK=block, DTYPE=_TL_DTYPE[gate_up.dtype],
            num_warps=4, **launch_options(gate_up.device))
    return out.view(*gate_up.shape[:-1], inter)
