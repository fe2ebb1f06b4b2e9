"""The vision encoder's 2-D rotary embedding of q and k, in one launch.

Owns: HF's vision rope arithmetic (`apply_rotary_pos_emb_vision`): q and k upcast to fp32, `x * cos +
rotate_half(x) * sin` in fp32 (each product rounded to fp32, then their sum), one cast back to the
activation dtype. The kernel does exactly those roundings (fused multiply-adds are switched off, so no
product skips its rounding): its results equal the reference's bit for bit. Rows are independent.

Why: in torch this is ~10 element-wise kernels per block over q and k (upcasts, a `cat` and a `neg` for
rotate_half, products, sums, downcasts): for 8 images of 448x448 on the 8B shapes ~9 ms of the encoder's
~24 ms of GPU time and ~540 of its launches.
"""

from __future__ import annotations

import torch

from .fused_norms import rotate_half
from .kv_write import HAVE_TRITON, _want_triton, device_context

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .fused_norms import _TL_DTYPE


def vision_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [N, heads, D] in the activation dtype (any strides); cos/sin [N, D] fp32 -> rotated q, k."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    qf, kf = q.float(), k.float()
    return (qf * c + rotate_half(qf) * s).to(q.dtype), (kf * c + rotate_half(kf) * s).to(k.dtype)


if HAVE_TRITON:

    @triton.jit
    def _vision_rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, stride_qt, stride_qh, stride_kt,
                            stride_kh, stride_cs, H, HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                            DTYPE: tl.constexpr):
        # grid = (tokens, 2): all heads of one token's q (axis 1 = 0) or k (1).
        t = tl.program_id(0).to(tl.int64)
        if tl.program_id(1) == 0:
            src, stride_t, stride_h, dst = q_ptr, stride_qt, stride_qh, qo_ptr
        else:
            src, stride_t, stride_h, dst = k_ptr, stride_kt, stride_kh, ko_ptr
        h = tl.arange(0, BLOCK_H)
        j = tl.arange(0, BLOCK_HALF)
        mask = (h < H)[:, None] & (j < HALF)[None, :]
        rows = src + t * stride_t + h[:, None].to(tl.int64) * stride_h
        x1 = tl.load(rows + j[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(rows + HALF + j[None, :], mask=mask, other=0.0).to(tl.float32)
        jmask = j < HALF
        c1 = tl.load(cos_ptr + t * stride_cs + j, mask=jmask, other=0.0)[None, :]
        c2 = tl.load(cos_ptr + t * stride_cs + HALF + j, mask=jmask, other=0.0)[None, :]
        s1 = tl.load(sin_ptr + t * stride_cs + j, mask=jmask, other=0.0)[None, :]
        s2 = tl.load(sin_ptr + t * stride_cs + HALF + j, mask=jmask, other=0.0)[None, :]
        o1 = x1 * c1 + (-x2) * s1  # rotate_half(x) = [-x2, x1]
        o2 = x2 * c2 + x1 * s2
        out = dst + t * H * 2 * HALF + h[:, None].to(tl.int64) * (2 * HALF)
        tl.store(out + j[None, :], o1.to(DTYPE), mask=mask)
        tl.store(out + HALF + j[None, :], o2.to(DTYPE), mask=mask)


def vision_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary of q, k [N, heads, D] (views of the fused qkv output are fine: the head dim must be unit-stride)
    by fp32 cos/sin [N, D]; contiguous outputs in q's dtype. One launch on CUDA."""
    if q.shape != k.shape or cos.shape != (q.shape[0], q.shape[2]) or sin.shape != cos.shape:
        raise ValueError(f"vision_rope: q {tuple(q.shape)}, k {tuple(k.shape)}, cos/sin {tuple(cos.shape)} "
                         f"/ {tuple(sin.shape)}: expected q, k [N, H, D] and cos, sin [N, D]")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("vision_rope: cos/sin must be float32 (HF rotates vision q/k in fp32)")
    if not _want_triton(q.device, use_triton) or q.shape[0] == 0:
        return vision_rope_reference(q, k, cos, sin)
    n, heads, d = q.shape
    if q.stride(2) != 1 or k.stride(2) != 1 or d % 2:
        raise ValueError(f"vision_rope needs unit-stride heads of an even dim, got D={d}")
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty((n, heads, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, heads, d), dtype=k.dtype, device=k.device)
    with device_context(q.device):
        _vision_rope_kernel[(n, 2)](q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0),
                                    k.stride(1), cos.stride(0), heads, d // 2,
                                    BLOCK_H=triton.next_power_of_2(heads),
                                    BLOCK_HALF=triton.next_power_of_2(d // 2), DTYPE=_TL_DTYPE[q.dtype],
                                    num_warps=4, enable_fp_fusion=False)
    return q_out, k_out
