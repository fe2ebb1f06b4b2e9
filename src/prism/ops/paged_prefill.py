"""Prefill attention straight from the paged (FP8) pool: one Triton kernel, no dense temporary.

Owns: attention for steps whose sequences add several tokens (a prefill chunk, the question after a
prefix hit), reading every key and value through the pool like `paged_attention_reference` (the spec,
same causal alignment, same GQA) but without gathering and dequantizing the context into a dense
tensor per sequence per layer (the engine we come from could not avoid that copy). FP8 payloads are
decoded in registers and the per-token scales are applied to the score and probability columns.

Layout: the new tokens of each sequence are cut into blocks of `_TOKENS` tokens; one program serves
one block and one KV head, its rows being (token, query head of the GQA group) pairs, so each key tile
is loaded once for the whole group. Each row's result depends only on its own query and its own
context, iterated in fixed tiles from position 0: nothing else in the batch changes it.
"""

from __future__ import annotations

import math

import torch

from ..kv.fp8 import KVPool
from . import kv_write
from .kv_write import HAVE_TRITON, _want_triton, device_context
from .paged_attention import PagedAttentionMetadata, kernel_operands, paged_attention_reference

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .paged_attention import _load_kv_tile

_LOG2E = 1.4426950408889634
_BLOCK_ROWS = 64  # rows (token, head) of one program
_BLOCK_N = 64  # keys per tile


def prefill_blocks(query_lens, context_lens, tokens_per_block: int) -> torch.Tensor:
    """Host int64 [num_blocks, 4]: (sequence, packed row of the block's first token, its absolute
    position, tokens in the block) for every block of `tokens_per_block` new tokens."""
    rows = []
    start = 0
    for b, (q, c) in enumerate(zip(query_lens, context_lens, strict=True)):
        for lo in range(0, q, tokens_per_block):
            rows.append((b, start + lo, c - q + lo, min(tokens_per_block, q - lo)))
        start += q
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)


if HAVE_TRITON:

    @triton.jit
    def _prefill_kernel(q_ptr, out_ptr, pay_ptr, sc_ptr, bt_ptr, ctx_ptr, blocks_ptr,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                        row_k, row_v, stride_row, stride_slot, sc_stride_row, page_size, qk_scale,
                        H, GROUP, HEAD_DIM,
                        KIND: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                        OFFSET_DTYPE: tl.constexpr):
        # grid = (blocks, KV heads). Row r of the tile is token r // GROUP of the block, query head r % GROUP.
        blk = tl.program_id(0)
        hk = tl.program_id(1)
        seq = tl.load(blocks_ptr + blk * 4)
        first_row = tl.load(blocks_ptr + blk * 4 + 1)
        first_pos = tl.load(blocks_ptr + blk * 4 + 2)
        count = tl.load(blocks_ptr + blk * 4 + 3)
        ctx = tl.load(ctx_ptr + seq)
        r = tl.arange(0, BLOCK_M)
        tok = r // GROUP
        head = hk * GROUP + r % GROUP
        rmask = tok < count
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        qmask = rmask[:, None] & dmask[None, :]
        q_rows = (first_row + tok).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + d[None, :],
                    mask=qmask, other=0.0)
        q = (q.to(tl.float32) * qk_scale).to(DOT_DTYPE)
        qpos = first_pos + tok  # absolute position of each row's token
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = bt_ptr + seq * stride_bt
        hi = tl.minimum(first_pos + count, ctx)  # keys past the block's last token are masked for every row
        for n0 in range(0, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < hi
            page = tl.load(bt_row + pos // page_size, mask=pmask, other=0)
            slot = page * page_size + pos % page_size
            k, k_f = _load_kv_tile(pay_ptr, sc_ptr, row_k, slot, hk, d, pmask, dmask, stride_row, stride_slot,
                                   sc_stride_row, H, HEAD_DIM, KIND, OFFSET_DTYPE)
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * k_f[None, :]
            visible = (pos[None, :] <= qpos[:, None]) & pmask[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v, v_f = _load_kv_tile(pay_ptr, sc_ptr, row_v, slot, hk, d, pmask, dmask, stride_row, stride_slot,
                                   sc_stride_row, H, HEAD_DIM, KIND, OFFSET_DTYPE)
            pv = (p * v_f[None, :]).to(DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(pv, v.to(DOT_DTYPE), input_precision=PRECISION)
            m_i = m_new
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        optr = out_ptr + q_rows[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + d[None, :]
        tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=qmask)


class PrefillLaunch:
    """The per-step part of a prefill launch (the block table of the query blocks on the device), built
    once per step on the host and reused by every layer."""

    def __init__(self, query_lens, context_lens, group: int, device: torch.device):
        self.group = group
        self.tokens = max(1, _BLOCK_ROWS // triton.next_power_of_2(group)) if HAVE_TRITON else 1
        self.blocks = prefill_blocks(query_lens, context_lens, self.tokens).to(device, non_blocking=True)


def paged_prefill_attention(q: torch.Tensor, pool: KVPool, layer: int, meta: PagedAttentionMetadata,
                            scale: float | None = None, *, launch: PrefillLaunch | None = None,
                            use_triton: bool | None = None) -> torch.Tensor:
    """q [N, H_q, D] of any step -> [N, H_q, D]; the reference's result up to fp32 / dot rounding. Triton on
    CUDA (one launch), `paged_attention_reference` elsewhere unless forced."""
    if not _want_triton(pool.device, use_triton):
        return paged_attention_reference(q, pool, layer, meta, scale)
    group, pay, sc = kernel_operands(q, pool, layer, meta)
    lay = pool.layout
    dim = q.shape[2]
    if launch is None:
        launch = PrefillLaunch(meta.query_lens, meta.context_lens_host, group, pool.device)
    block_m = triton.next_power_of_2(launch.tokens * group)
    block_d = triton.next_power_of_2(dim)
    sm_scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dot_dtype, precision = {torch.float32: (tl.float32, "ieee"), torch.float16: (tl.float16, "tf32"),
                            torch.bfloat16: (tl.bfloat16, "tf32")}[q.dtype]
    num_blocks = launch.blocks.shape[0]
    with device_context(pool.device):
        _prefill_kernel[(num_blocks, lay.num_kv_heads)](
            q, out, pay, sc, meta.block_table, meta.context_lens, launch.blocks,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_table.stride(0),
            layer, lay.num_layers + layer, lay.num_slots * lay.num_kv_heads * dim, lay.num_kv_heads * dim,
            lay.num_slots * lay.num_kv_heads, lay.page_size, sm_scale * _LOG2E,
            lay.num_kv_heads, group, dim,
            KIND=kv_write._KINDS[lay.kv_dtype], TOKENS=launch.tokens, BLOCK_M=block_m, BLOCK_N=_BLOCK_N,
            BLOCK_D=block_d, DOT_DTYPE=dot_dtype, PRECISION=precision, OFFSET_DTYPE=kv_write._OFFSET_DTYPE,
            num_warps=4, num_stages=2,
        )
    return out
