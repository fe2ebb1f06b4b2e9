"""Q/K RMSNorm + M-RoPE + the K/V write (FP8 quantization included) in one launch per decoder layer.

Owns: `qk_norm_rope_write_kv` leaves exactly the bytes, and returns exactly the q, of `qk_norm_rope` followed by
`write_kv` (the two launches it replaces). The rotated K never goes through memory: the program that norms and
rotates a token's key heads quantizes them into the pool from registers, one scale per head as `_write_one`
computes it; another program stores the token's value heads the same way, a third its query heads. Rounding
steps are the unfused kernels' (each product rounded to the activation dtype, the sum rounded again before
the write), so the equality is bitwise, and HF parity carries over.
"""

from __future__ import annotations

import torch

from ..kv.fp8 import KVPool
from . import kv_write
from .fused_norms import check_rope_heads
from .kv_write import HAVE_TRITON, device_context
from .pdl import launch_options

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .fused_norms import _TL_DTYPE, _norm_rope_heads, norm_rope_values
    from .kv_write import _write_one, write_head_halves
    from .pdl import wait_for_predecessors

    @triton.jit(do_not_specialize=["row_k", "row_v"])  # one variant for every layer
    def _qk_norm_rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, slots_ptr,
                                      pay_ptr, sc_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                                      stride_vh, stride_cs, HQ, HKV, eps, row_k, row_v, num_slots, stride_row,
                                      stride_slot, sc_stride_row, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                                      BLOCK_HKV: tl.constexpr, DTYPE: tl.constexpr, KIND: tl.constexpr,
                                      OFFSET_DTYPE: tl.constexpr, PDL: tl.constexpr):
        # grid = (tokens, 3): a token's query heads -> q_out (1 = its key heads, 2 = its value heads -> the pool).
        wait_for_predecessors(PDL)
        t = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        cos_row, sin_row = cos_ptr + t * stride_cs, sin_ptr + t * stride_cs
        if part == 0:
            _norm_rope_heads(q_ptr + t * stride_qt, stride_qh, qw_ptr, cos_row, sin_row, qo_ptr + t * HQ * 2 * HALF,
                             HQ, eps, HALF, BLOCK_HQ, DTYPE)
        else:
            slot = tl.load(slots_ptr + t)
            ok = (slot >= 0) & (slot < num_slots)  # as write_kv: a slot outside the pool is skipped
            if part == 1:
                k1, k2, h, j = norm_rope_values(k_ptr + t * stride_kt, stride_kh, kw_ptr, cos_row, sin_row, HKV, eps,
                                                HALF, BLOCK_HKV, DTYPE)
                write_head_halves(k1, k2, pay_ptr, sc_ptr, slot, ok, row_k, h, j, HKV, HALF, stride_row,
                                  stride_slot, sc_stride_row, KIND, OFFSET_DTYPE)
            else:
                _write_one(v_ptr, stride_vt, stride_vh, 1, pay_ptr, sc_ptr, t, slot, ok, row_v,
                           tl.arange(0, BLOCK_HKV), tl.arange(0, 2 * HALF), HKV, 2 * HALF, stride_row, stride_slot,
                           sc_stride_row, KIND, OFFSET_DTYPE)


def qk_norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                          k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool,
                          layer: int, slots: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D] and k, v [N, Hkv, D] (views of the fused qkv output are fine: unit-stride heads) -> the normed,
    rotated q [N, Hq, D]; the normed, rotated k and v are written to `slots` of `layer`. Triton only (CUDA, or the
    interpreter): callers without it run `qk_norm_rope` then `write_kv`."""
    if not HAVE_TRITON:
        raise RuntimeError("qk_norm_rope_write_kv needs Triton")
    kv_write._check_write_inputs(pool, layer, slots, k, v)
    n, hq, d = q.shape
    hkv = k.shape[1]
    check_rope_heads("qk_norm_rope_write_kv", q, k, v)
    q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return q_out
    lay = pool.layout
    if slots.device != pool.device:
        slots = slots.to(pool.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    pay, sc = kv_write.store_operands(pool)
    with device_context(q.device):
        _qk_norm_rope_write_kv_kernel[(n, 3)](
            q, k, v, q_weight, k_weight, cos, sin, q_out, slots, pay, sc,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            hq, hkv, eps, layer, lay.num_layers + layer, lay.num_slots, *kv_write.row_strides(lay),
            HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HKV=triton.next_power_of_2(hkv),
            DTYPE=_TL_DTYPE[q.dtype], KIND=kv_write._KINDS[lay.kv_dtype], OFFSET_DTYPE=kv_write._OFFSET_DTYPE,
            num_warps=4, **launch_options(q.device),
        )
    return q_out
