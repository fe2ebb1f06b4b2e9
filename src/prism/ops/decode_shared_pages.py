"""Decode attention that reads a key tile once for every sequence sharing its page (the repeated-image batch).

Owns nothing new: the output is `paged_attention.paged_attention_reference`'s, as from `_decode_kernel`. The
difference is the work. `_decode_kernel` runs one program per sequence, so 32 sequences over the same 8 images
read and decode each shared FP8 page 32 times (W3 batch 32: 42.5 us per layer against 5.8 us for one sequence).
Here one program serves `SEQS` consecutive sequences (their query heads of one KV head are the rows of the
`tl.dot` tiles: 4 sequences x a GQA group of 4 fill the 16 rows one sequence pads). For each key tile it checks,
on the device, whether every sequence that reaches the tile maps it to the same physical pages: then the tile is
loaded and decoded once for all rows; else each sequence's own tile is loaded and its rows take their scores and
values from it (the work of `_decode_kernel`, in one program). The scores, the online softmax and the split
layout are `_decode_kernel`'s, so `_decode_reduce_kernel` merges the splits.
"""

from __future__ import annotations

from .kv_write import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .paged_attention import _load_kv_tile, _store_attention

    @triton.jit
    def _softmax_step(s, qpos, pos, pmask, m_i, l_i):
        """Online-softmax update of rows with scores `s` (log2 units) over keys `pos`: (p, alpha, m, l)."""
        s = tl.where((pos[None, :] <= qpos[:, None]) & pmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible stays at p = 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)

    # Not specialized: the block table's width and the layer's rows (see `_decode_kernel`).
    @triton.jit(do_not_specialize=["stride_bt", "row_k", "row_v"])
    def _decode_shared_pages_kernel(
            q_ptr, out_ptr, pay_ptr, sc_ptr, bt_ptr, ctx_ptr, part_acc_ptr, part_ml_ptr,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
            row_k, row_v, stride_row, stride_slot, sc_stride_row, page_size, qk_scale,
            B, H, HQ, GROUP, HEAD_DIM,
            KIND: tl.constexpr, NUM_SPLITS: tl.constexpr, SEQS: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
            OFFSET_DTYPE: tl.constexpr, NATIVE_FP8: tl.constexpr):
        # grid = (ceil(B / SEQS), KV heads, splits). Row r: sequence first + r // GROUP, query head hk * GROUP +
        # r % GROUP. The splits divide the longest context of the program's sequences (whole BLOCK_N tiles).
        first = tl.program_id(0) * SEQS
        hk = tl.program_id(1)
        split = tl.program_id(2)
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        row_seq = first + r // GROUP
        rmask = (r < SEQS * GROUP) & (row_seq < B)
        heads = hk * GROUP + r % GROUP
        ctx_r = tl.load(ctx_ptr + row_seq, mask=rmask, other=0).to(tl.int32)
        seqs = first + tl.arange(0, SEQS)
        smask = seqs < B
        ctx_s = tl.load(ctx_ptr + seqs, mask=smask, other=0).to(tl.int32)
        longest = tl.max(ctx_s, axis=0)
        split_len = tl.cdiv(tl.cdiv(longest, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, longest)
        q = tl.load(q_ptr + row_seq[:, None].to(tl.int64) * stride_qt + heads[:, None].to(tl.int64) * stride_qh
                    + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        q = (q.to(tl.float32) * qk_scale).to(DOT_DTYPE)
        qpos = ctx_r - 1  # each row's new token sees its own whole context
        ctx_first = tl.load(ctx_ptr + first).to(tl.int32)
        bt_first = bt_ptr + first.to(tl.int64) * stride_bt
        bt_seqs = bt_ptr + seqs[:, None].to(tl.int64) * stride_bt
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < hi
            # The first sequence's pages for this tile, and whether every sequence reaching a key agrees.
            ref = tl.load(bt_first + pos // page_size, mask=pmask & (pos < ctx_first), other=-1)
            reach = smask[:, None] & (pos[None, :] < ctx_s[:, None]) & pmask[None, :]
            pages = tl.load(bt_seqs + (pos // page_size)[None, :], mask=reach, other=-1)
            differs = tl.max(tl.max((reach & (pages != ref[None, :])).to(tl.int32), axis=1), axis=0)
            if differs == 0:
                slot = ref * page_size + pos % page_size
                k, k_f = _load_kv_tile(pay_ptr, sc_ptr, row_k, slot, hk, d, pmask, dmask, stride_row, stride_slot,
                                       sc_stride_row, H, HEAD_DIM, KIND, OFFSET_DTYPE, DOT_DTYPE, NATIVE_FP8)
                v, v_f = _load_kv_tile(pay_ptr, sc_ptr, row_v, slot, hk, d, pmask, dmask, stride_row, stride_slot,
                                       sc_stride_row, H, HEAD_DIM, KIND, OFFSET_DTYPE, DOT_DTYPE, NATIVE_FP8)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * k_f[None, :]
                p, alpha, m_i, l_i = _softmax_step(s, qpos, pos, pmask, m_i, l_i)
                pv = tl.dot((p * v_f[None, :]).to(DOT_DTYPE), v, input_precision=PRECISION)
            else:
                s = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
                for i in tl.static_range(SEQS):  # each sequence's own tile, for its own rows
                    # Only the keys it reaches: past its context a slot may hold anything (an FP8 NaN pattern
                    # times a zero probability would still be NaN).
                    kmask = pmask & (pos < tl.load(ctx_ptr + first + i, mask=first + i < B, other=0))
                    own = tl.load(bt_ptr + (first + i).to(tl.int64) * stride_bt + pos // page_size, mask=kmask,
                                  other=0)
                    k, k_f = _load_kv_tile(pay_ptr, sc_ptr, row_k, own * page_size + pos % page_size, hk, d, kmask,
                                           dmask, stride_row, stride_slot, sc_stride_row, H, HEAD_DIM, KIND,
                                           OFFSET_DTYPE, DOT_DTYPE, NATIVE_FP8)
                    s_i = tl.dot(q, tl.trans(k), input_precision=PRECISION) * k_f[None, :]
                    s = tl.where((r // GROUP == i)[:, None], s_i, s)
                p, alpha, m_i, l_i = _softmax_step(s, qpos, pos, pmask, m_i, l_i)
                pv = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
                for i in tl.static_range(SEQS):
                    kmask = pmask & (pos < tl.load(ctx_ptr + first + i, mask=first + i < B, other=0))
                    own = tl.load(bt_ptr + (first + i).to(tl.int64) * stride_bt + pos // page_size, mask=kmask,
                                  other=0)
                    v, v_f = _load_kv_tile(pay_ptr, sc_ptr, row_v, own * page_size + pos % page_size, hk, d, kmask,
                                           dmask, stride_row, stride_slot, sc_stride_row, H, HEAD_DIM, KIND,
                                           OFFSET_DTYPE, DOT_DTYPE, NATIVE_FP8)
                    p_i = tl.where((r // GROUP == i)[:, None], p * v_f[None, :], 0.0)
                    pv += tl.dot(p_i.to(DOT_DTYPE), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
        _store_attention(m_i, l_i, acc, row_seq, heads, rmask, d, dmask, out_ptr, stride_ot, stride_oh,
                         part_acc_ptr, part_ml_ptr, split, HQ, HEAD_DIM, NUM_SPLITS)

    def shared_pages_block_rows(seqs: int, group: int) -> int:
        """Rows of the program's `tl.dot` tiles: its sequences' query heads, padded to a power of two >= 16."""
        return max(16, triton.next_power_of_2(seqs * group))
