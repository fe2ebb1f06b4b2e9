"""Attention over the paged KV pool: torch reference (the spec), decode kernel, backend (the step's layout is
`attention_metadata.PagedAttentionMetadata`).

Owns the read half of hit == miss: attention ALWAYS reads K/V back through the pool (dequantized with
`fp8.dequantize_kv` semantics), even for the tokens written this step, so a prefix that was cached earlier
and one computed in this step give the same numbers. Causality is aligned bottom-right: query i of a
sequence with q_len new tokens and context c (cached prefix + new tokens) sits at position c - q_len + i and
sees positions <= that. GQA is native (no K/V head copies).

`paged_attention_reference` runs each sequence alone and its queries in blocks aligned to page boundaries
(absolute positions), each block over keys [0, block end): a page's queries get bitwise the same output
whether earlier pages were computed in an earlier step or in this one, and whatever else is in the batch.

`paged_decode_attention` is the Triton kernel for q_len == 1: one program per (sequence, KV head, context
split) serving the GQA group's query heads as the rows of `tl.dot` tiles (operands in q's dtype: the FP8
payload decodes exactly into fp16/bf16, the per-token scales multiply the score and probability columns),
fp32 online softmax, 64-bit offsets (`kv_write.slot_offset` under `_OFFSET_DTYPE`); with several splits a
second kernel merges the partial softmaxes. (The Triton interpreter's `tl.dot` is wrong for bf16
operands, so CPU tests run it in fp32/fp16.)
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..kv import fp8
from ..kv.fp8 import KVPool
from . import kv_write
from .attention_metadata import _INDEX, PagedAttentionMetadata, _cdiv
from .fused_norms import qk_norm_rope
from .kv_write import HAVE_TRITON, _check_layer, _want_triton, device_context, write_kv
from .pdl import launch_options
from .qk_norm_rope_kv import qk_norm_rope_write_kv

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .kv_write import slot_offset
    from .pdl import wait_for_predecessors

_LOG2E = 1.4426950408889634
# Decode launch knobs (`bench/tune_decode_attention.py` sweeps them on the GPU): keys per tile, the most
# splits of one context, the fewest tokens worth a split, the programs a launch aims for, warps per program
# and the pipeline depth of the key loop.
# H200 sweep (2026-11-29, contexts of 1,700 tokens, bench/RESULTS.md): the kernel is latency-bound per tile
# (a page lookup, then dependent K and V loads), so few programs walking many large tiles beat many short
# splits: batch 1 11.0 -> 7.0 us, 16 rows of one sequence 78 -> 28 us, batch 32 121 -> 67 us per layer.
_BLOCK_N = 128
_MAX_SPLITS = 64
_MIN_SPLIT_TOKENS = 128
_TARGET_PROGRAMS = 192
_NUM_WARPS = 4
# A tile's V load issued beside its K load (see `_attend_keys`), then two pipeline stages (alone, pipelining did
# not help). H200 sweep (`bench/tune_decode_attention.py --focused`), us per layer: batch 32 at 1,700 tokens
# 70.3 -> 55.5, 16 rows of one sequence 29.0 -> 24.8, batch 1 6.9 -> 7.0.
_NUM_STAGES = 2
_V_WITH_K = True


def _check_attention_inputs(q: torch.Tensor, pool: KVPool, layer: int, meta: PagedAttentionMetadata) -> None:
    _check_layer(pool, layer)
    lay = pool.layout
    if not isinstance(q, torch.Tensor) or not q.is_floating_point() or q.dim() != 3:
        raise ValueError(f"q must be a floating [N, H_q, D] tensor, got {getattr(q, 'shape', type(q))}")
    n, hq, d = q.shape
    if n != meta.num_tokens:
        raise ValueError(f"q has {n} tokens, the metadata {meta.num_tokens}")
    if d != lay.head_dim or hq % lay.num_kv_heads != 0:
        raise ValueError(f"q heads/dim {hq}/{d} do not fit the pool's {lay.num_kv_heads} KV heads of dim "
                         f"{lay.head_dim} (H_q must be a multiple of H_kv)")
    if meta.page_size != lay.page_size:
        raise ValueError(f"metadata page_size {meta.page_size} != pool page_size {lay.page_size}")
    if meta.max_page >= lay.num_pages:
        raise ValueError(f"block_table holds page {meta.max_page}; the pool has {lay.num_pages} pages")
    for name, dev in (("q", q.device), ("metadata", meta.block_table.device)):
        if dev != pool.device:
            raise ValueError(f"{name} is on {dev}, the pool on {pool.device}")


def kernel_operands(q: torch.Tensor, pool: KVPool, layer: int, meta: PagedAttentionMetadata
                    ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Checks shared by the attention kernels; returns the GQA group size, the payload as the integer view
    the kernels decode (fp8: bytes, bf16: int16 bits) and the scales tensor (the payload when unscaled)."""
    _check_attention_inputs(q, pool, layer, meta)
    if q.stride(2) != 1:
        raise ValueError("q's head_dim must be contiguous")
    lay = pool.layout
    pay = pool.payload.view(torch.uint8) if lay.scaled else (
        pool.payload.view(torch.int16) if lay.kv_dtype == "bf16" else pool.payload)
    return q.shape[1] // lay.num_kv_heads, pay, pool.scales if pool.scales is not None else pay


# ------------------------------------------------------------------------------------------- reference


def _gather(pool: KVPool, kv: int, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K (kv=0) or V (kv=1) of `layer` at `slots` -> [n, H, D] in `dtype`, dequantized for fp8 pools."""
    lay = pool.layout
    rows = pool.payload_bits()[kv, layer].view(lay.num_slots, lay.num_kv_heads, lay.head_dim)
    payload = rows.index_select(0, slots).view(lay.payload_dtype)
    if not lay.scaled:
        return payload.to(dtype)
    assert pool.scales is not None
    scales = pool.scales[kv, layer].view(lay.num_slots, lay.num_kv_heads).index_select(0, slots)
    return fp8.dequantize_kv(payload, scales, dtype)


def paged_attention_reference(q: torch.Tensor, pool: KVPool, layer: int, meta: PagedAttentionMetadata,
                              scale: float | None = None) -> torch.Tensor:
    """Spec: q [N, H_q, D] -> [N, H_q, D] in q's dtype; K/V of positions [0, context_len) read back from the
    pool (dequantized to q's dtype), causal aligned bottom-right, per sequence, queries in page-aligned
    blocks (see the module docstring). No host sync."""
    _check_attention_inputs(q, pool, layer, meta)
    page = meta.page_size
    gqa = q.shape[1] != pool.layout.num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for b, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host, strict=True)):
        pos = torch.arange(ctx, dtype=_INDEX, device=pool.device)
        slots = meta.block_table[b].index_select(0, pos // page) * page + pos % page
        k_all, v_all = (_gather(pool, kv, layer, slots, q.dtype) for kv in (0, 1))
        first = ctx - q_len  # absolute position of the sequence's first new token
        lo = first
        while lo < ctx:
            hi = min(ctx, (lo // page + 1) * page)  # the next page boundary
            # q copied to fresh memory, keys sliced from the start of the gathered tensors: this SDPA call sees
            # the same shapes, strides and alignment whatever else the step computes.
            qb = q[start + lo - first: start + hi - first].transpose(0, 1).clone()
            kb, vb = (t[:hi].transpose(0, 1) for t in (k_all, v_all))
            qpos = torch.arange(lo, hi, device=pool.device)
            mask = torch.arange(hi, device=pool.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[start + lo - first: start + hi - first] = o.transpose(0, 1)
            lo = hi
        start += q_len
    return out


# ---------------------------------------------------------------------------------------------- Triton

if HAVE_TRITON:

    @triton.jit
    def _load_kv_tile(pay_ptr, sc_ptr, row, slot, hk, d, pmask, dmask, stride_row, stride_slot, sc_stride_row,
                      H, HEAD_DIM, KIND: tl.constexpr, OFFSET_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                      NATIVE_FP8: tl.constexpr):
        """[BLOCK_N, BLOCK_D] payload of KV head hk at `slot` in OUT_DTYPE (fp8: the unscaled E4M3 value * 2^-8,
        exact in fp16, bf16 and fp32), and the per-token factor that finishes the dequantization (fp8: scale *
        256, else 1). Decoded straight to the dot dtype: no fp32 copy of the tile in registers. The 2^8 sits
        on the factor so that probability x factor, rounded to fp16 for the second dot, stays clear of fp16's
        subnormals when the scales are small."""
        off = slot_offset(row, slot[:, None], hk * HEAD_DIM + d[None, :], stride_row, stride_slot,
                                   OFFSET_DTYPE)
        m2 = pmask[:, None] & dmask[None, :]
        if KIND == 0:
            b = tl.load(pay_ptr + off, mask=m2, other=0)
            if NATIVE_FP8:
                # The hardware's E4M3 -> fp16 conversion (sm_89+; two values per instruction), then an exact
                # power-of-two step. The bits decoded by hand below cost ~10 integer operations per element.
                x = (b.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 0.00390625).to(OUT_DTYPE)
            else:
                # E4M3FN bits placed in an fp16 (sign, then exponent+mantissa shifted up 7) read as value *
                # 2^-8, subnormals included.
                bits = b.to(tl.int32)
                h16 = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
                x = h16.to(tl.int16).to(tl.float16, bitcast=True).to(OUT_DTYPE)
            sc = tl.load(sc_ptr + slot_offset(row, slot, hk, sc_stride_row, H, OFFSET_DTYPE),
                         mask=pmask, other=0.0)
            factor = sc * 256.0
        elif KIND == 1:
            x = tl.load(pay_ptr + off, mask=m2, other=0).to(tl.int16).to(tl.bfloat16, bitcast=True).to(OUT_DTYPE)
            factor = tl.full(pmask.shape, 1.0, tl.float32)
        else:
            x = tl.load(pay_ptr + off, mask=m2, other=0.0).to(OUT_DTYPE)
            factor = tl.full(pmask.shape, 1.0, tl.float32)
        return x, factor

    @triton.jit
    def _attend_tile(q, qpos, n0, hi, m_i, l_i, acc, bt_row, pay_ptr, sc_ptr, row_k, row_v, hk, d, dmask,
                     stride_row, stride_slot, sc_stride_row, page_size, H, HEAD_DIM,
                     BLOCK_N: tl.constexpr, KIND: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     PRECISION: tl.constexpr, OFFSET_DTYPE: tl.constexpr, NATIVE_FP8: tl.constexpr,
                     V_WITH_K: tl.constexpr, MASKED: tl.constexpr):
        """One BLOCK_N-key tile [n0, n0 + BLOCK_N) folded into the online softmax (m_i, l_i, acc). MASKED=False
        is for tiles that every row sees whole (all keys < hi and <= every qpos): the same numbers without
        the causal and bounds selects."""
        pos = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            pmask = pos < hi
        else:
            pmask = tl.full([BLOCK_N], 1, tl.int1)
        page = tl.load(bt_row + pos // page_size, mask=pmask, other=0)
        slot = page * page_size + pos % page_size  # int64: page ids are int64
        k, k_f = _load_kv_tile(pay_ptr, sc_ptr, row_k, slot, hk, d, pmask, dmask, stride_row, stride_slot,
                               sc_stride_row, H, HEAD_DIM, KIND, OFFSET_DTYPE, DOT_DTYPE, NATIVE_FP8)
        if V_WITH_K:
            v, v_f = _load_kv_tile(pay_ptr, sc_ptr, row_v, slot, hk, d, pmask, dmask, stride_row, stride_slot,
                                   sc_stride_row, H, HEAD_DIM, KIND, OFFSET_DTYPE, DOT_DTYPE, NATIVE_FP8)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * k_f[None, :]
        if MASKED:
            s = tl.where((pos[None, :] <= qpos[:, None]) & pmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible stays at p = 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if not V_WITH_K:
            v, v_f = _load_kv_tile(pay_ptr, sc_ptr, row_v, slot, hk, d, pmask, dmask, stride_row, stride_slot,
                                   sc_stride_row, H, HEAD_DIM, KIND, OFFSET_DTYPE, DOT_DTYPE, NATIVE_FP8)
        pv = (p * v_f[None, :]).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _attend_keys(q, qpos, lo, full_hi, hi, bt_row, pay_ptr, sc_ptr, row_k, row_v, hk, d, dmask,
                     stride_row, stride_slot, sc_stride_row, page_size, H, HEAD_DIM,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr,
                     DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, OFFSET_DTYPE: tl.constexpr,
                     NUM_STAGES: tl.constexpr, NATIVE_FP8: tl.constexpr, V_WITH_K: tl.constexpr,
                     SPLIT_MASKED: tl.constexpr):
        """Online softmax of the query rows `q` (pre-scaled, log2 units) over keys [lo, hi) of one sequence's
        pages, in BLOCK_N-key tiles, each row seeing keys <= its `qpos`. Returns (max, sum, unnormalized acc).
        `SPLIT_MASKED`: the tiles [lo, full_hi) (whole tiles every row sees entirely; `full_hi` - lo a
        multiple of BLOCK_N) skip the masks, as flash attention splits its causal loop; the tiles after them
        are masked. The same arithmetic as the masked loop, but on CUDA the compiler may fuse an unmasked
        tile's score scaling into the exponent's argument (an FMA: one rounding fewer; with the select between
        them the masked loop rounds the score first), so rows can differ from the single masked loop's in the
        last bits. The interpreter does not fuse: there the two are bitwise equal.
        `V_WITH_K`: issue a tile's V load beside its K load, so the two memory latencies overlap instead of
        following each other (the decode kernel waits on memory; the prefill kernel's larger tiles need the
        registers)."""
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        first_masked = lo
        if SPLIT_MASKED:
            for n0 in tl.range(lo, full_hi, BLOCK_N, num_stages=NUM_STAGES):
                m_i, l_i, acc = _attend_tile(q, qpos, n0, hi, m_i, l_i, acc, bt_row, pay_ptr, sc_ptr, row_k,
                                             row_v, hk, d, dmask, stride_row, stride_slot, sc_stride_row,
                                             page_size, H, HEAD_DIM, BLOCK_N, KIND, DOT_DTYPE, PRECISION,
                                             OFFSET_DTYPE, NATIVE_FP8, V_WITH_K, False)
            first_masked = full_hi
        for n0 in tl.range(first_masked, hi, BLOCK_N, num_stages=NUM_STAGES):  # the next tiles' loads overlap
            m_i, l_i, acc = _attend_tile(q, qpos, n0, hi, m_i, l_i, acc, bt_row, pay_ptr, sc_ptr, row_k, row_v,
                                         hk, d, dmask, stride_row, stride_slot, sc_stride_row, page_size, H,
                                         HEAD_DIM, BLOCK_N, KIND, DOT_DTYPE, PRECISION, OFFSET_DTYPE,
                                         NATIVE_FP8, V_WITH_K, True)
        return m_i, l_i, acc

    @triton.jit
    def _store_attention(m_i, l_i, acc, tokens, heads, rmask, d, dmask, out_ptr, stride_ot, stride_oh,
                         part_acc_ptr, part_ml_ptr, split, HQ, HEAD_DIM, NUM_SPLITS: tl.constexpr):
        """Row (token, head): the normalized output, or with several splits the partial softmax in the layout
        [tokens, HQ, NUM_SPLITS, (D | 2)] that `_decode_reduce_kernel` merges."""
        tokens = tokens.to(tl.int64)
        heads = heads.to(tl.int64)
        mask = rmask[:, None] & dmask[None, :]
        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            optr = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
            tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            base = (tokens * HQ + heads) * NUM_SPLITS + split
            tl.store(part_acc_ptr + base[:, None] * HEAD_DIM + d[None, :], acc, mask=mask)
            tl.store(part_ml_ptr + base * 2, m_i, mask=rmask)
            tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=rmask)

    # Not specialized: the block table's width (changes every step) and the layer's rows (one variant per
    # layer kind would compile, or load from Triton's disk cache, for 0.1-2 s in the middle of serving).
    @triton.jit(do_not_specialize=["stride_bt", "row_k", "row_v"])
    def _decode_kernel(q_ptr, out_ptr, pay_ptr, sc_ptr, bt_ptr, ctx_ptr, prefix_ptr, part_acc_ptr, part_ml_ptr,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                       row_k, row_v, stride_row, stride_slot, sc_stride_row, page_size, qk_scale,
                       H, HQ, GROUP, HEAD_DIM,
                       KIND: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_SLOTS: tl.constexpr,
                       SKIP_PREFIX: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr,
                       PRECISION: tl.constexpr, OFFSET_DTYPE: tl.constexpr, NUM_STAGES: tl.constexpr,
                       NATIVE_FP8: tl.constexpr, V_WITH_K: tl.constexpr, PDL: tl.constexpr):
        # grid = (sequences, KV heads, splits). Scores are kept in log2 units (q pre-scaled by scale * log2 e).
        # The GQA group's query heads are the rows of two tl.dot per key tile (padded to BLOCK_G >= 16).
        # Each sequence spreads its OWN context over the splits (whole BLOCK_N tiles each): a CUDA graph
        # captured for the longest context still gives a short context all its programs.
        # SKIP_PREFIX (cascade attention): the first prefix_ptr[b] keys are attended by the shared-prefix pass,
        # so the splits cover [prefix, ctx); the partials go to slots [0, NUM_SPLITS) of SPLIT_SLOTS per row.
        wait_for_predecessors(PDL)
        b = tl.program_id(0)
        hk = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + b).to(tl.int32)
        start = 0
        if SKIP_PREFIX:
            start = tl.load(prefix_ptr + b).to(tl.int32)
        split_len = tl.cdiv(tl.cdiv(ctx - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = start + split * split_len
        hi = tl.minimum(lo + split_len, ctx)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        gmask = g < GROUP
        dmask = d < HEAD_DIM
        qh = hk * GROUP + g
        qmask = gmask[:, None] & dmask[None, :]
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + qh[:, None].to(tl.int64) * stride_qh + d[None, :],
                    mask=qmask, other=0.0)
        q = (q.to(tl.float32) * qk_scale).to(DOT_DTYPE)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        qpos = tl.zeros([BLOCK_G], tl.int32) + (ctx - 1)  # the new token: it sees its whole context
        m_i, l_i, acc = _attend_keys(q, qpos, lo, lo, hi, bt_row, pay_ptr, sc_ptr, row_k, row_v, hk, d, dmask,
                                     stride_row, stride_slot, sc_stride_row, page_size, H, HEAD_DIM,
                                     BLOCK_G, BLOCK_N, BLOCK_D, KIND, DOT_DTYPE, PRECISION, OFFSET_DTYPE,
                                     NUM_STAGES, NATIVE_FP8, V_WITH_K, False)
        _store_attention(m_i, l_i, acc, tl.zeros([BLOCK_G], tl.int32) + b, qh, gmask, d, dmask, out_ptr,
                         stride_ot, stride_oh, part_acc_ptr, part_ml_ptr, split, HQ, HEAD_DIM, SPLIT_SLOTS)

    def dot_dtype(q_dtype: torch.dtype, kv_dtype: str):
        """The tl.dot operand dtype and precision. fp32 q: fp32 with exact products (the CPU tests). Else fp16,
        which holds bf16 q and every FP8 value exactly and rounds the probabilities 8x finer than bf16; a
        bf16 pool (values beyond fp16's range) uses tf32, as precise as fp16 with bf16's range."""
        if q_dtype == torch.float32:
            return tl.float32, "ieee"
        return (tl.float32, "tf32") if kv_dtype == "bf16" else (tl.float16, "tf32")

    @triton.jit
    def _decode_reduce_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, HQ, HEAD_DIM,
                              NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                              PDL: tl.constexpr):
        # grid = (sequences, query heads): merge the splits' partial softmaxes (empty splits: m = -inf, l = 0).
        wait_for_predecessors(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        smask = s < NUM_SPLITS
        dmask = d < HEAD_DIM
        base = (b.to(tl.int64) * HQ + h) * NUM_SPLITS + s
        m = tl.load(part_ml_ptr + base * 2, mask=smask, other=float("-inf"))
        l = tl.load(part_ml_ptr + base * 2 + 1, mask=smask, other=0.0)
        acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None] & dmask[None, :],
                      other=0.0)
        m_max = tl.max(m, axis=0)  # finite: split 0 always holds the row's first key it attends itself
        w = tl.exp2(m - m_max)
        o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        optr = out_ptr + b.to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh + d
        tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=dmask)


@functools.cache
def native_fp8(device: torch.device) -> bool:
    """Whether the attention kernels decode E4M3 with the hardware's conversion: sm_89 (Ada, Hopper) and newer,
    and the CPU interpreter; older GPUs (A100) decode the bits by hand, to the same values."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int) -> int:
    """Context splits of a decode launch: enough programs to keep the device's memory pipes busy (the
    kernel is latency-bound: one program walks its split tile after tile), none shorter than
    `_MIN_SPLIT_TOKENS` for the longest context, at most `_MAX_SPLITS`. Each sequence divides its own
    context by this count inside the kernel."""
    want = _cdiv(_TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads))
    return power_of_two_at_most(max(1, min(want, _cdiv(max_context_len, _MIN_SPLIT_TOKENS), _MAX_SPLITS)))


def power_of_two_at_most(n: int) -> int:
    """Split counts are kernel constants: keeping them to powers of two bounds the JIT variants (a new
    variant compiles for a second or more, in the middle of serving)."""
    return 1 << (n.bit_length() - 1)


def paged_decode_attention(q: torch.Tensor, pool: KVPool, layer: int, meta: PagedAttentionMetadata,
                           scale: float | None = None, *, use_triton: bool | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence (q [B, H_q, D]) over its paged context; same result as
    `paged_attention_reference` up to fp32 rounding. Triton on CUDA, the reference on CPU unless forced.
    `num_splits` (default `decode_num_splits`) splits each context across programs, merged by a second kernel."""
    if not meta.is_decode:
        raise ValueError(f"paged_decode_attention needs query_len == 1 for every sequence, got "
                         f"{meta.query_lens}")
    if not _want_triton(pool.device, use_triton):
        return paged_attention_reference(q, pool, layer, meta, scale)  # the same attention, shared prefix or not
    group, pay, sc = kernel_operands(q, pool, layer, meta)
    lay = pool.layout
    bsz, hq, dim = q.shape
    if num_splits is None:
        num_splits = decode_num_splits(bsz, lay.num_kv_heads, meta.max_context_len)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    # With a shared prefix (cascade attention) each row's own keys start after it, and the shared pass's partial
    # softmaxes take the slots after the decode kernel's splits.
    shared = meta.shared_prefix
    slots = num_splits + (shared.splits if shared is not None else 0)
    qk_scale = (1.0 / math.sqrt(dim) if scale is None else float(scale)) * _LOG2E
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dev = pool.device
    dot, precision = dot_dtype(q.dtype, lay.kv_dtype)
    block_d = triton.next_power_of_2(dim)
    if slots > 1:
        part_acc = torch.empty((bsz, hq, slots, dim), dtype=torch.float32, device=dev)
        part_ml = torch.empty((bsz, hq, slots, 2), dtype=torch.float32, device=dev)
    else:
        part_acc = part_ml = out  # unused placeholders
    common = dict(KIND=kv_write._KINDS[lay.kv_dtype], SPLIT_SLOTS=slots, BLOCK_D=block_d, DOT_DTYPE=dot,
                  PRECISION=precision, OFFSET_DTYPE=kv_write._OFFSET_DTYPE, NATIVE_FP8=native_fp8(dev))
    with device_context(dev):
        _decode_kernel[(bsz, lay.num_kv_heads, num_splits)](
            q, out, pay, sc, meta.block_table, meta.context_lens,
            meta.context_lens if shared is None else shared.prefix_lens, part_acc, part_ml,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_table.stride(0),
            layer, lay.num_layers + layer, *kv_write.row_strides(lay), lay.page_size, qk_scale,
            lay.num_kv_heads, hq, group, dim,
            NUM_SPLITS=num_splits, SKIP_PREFIX=shared is not None,
            BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs 16 rows
            BLOCK_N=_BLOCK_N, NUM_STAGES=_NUM_STAGES, V_WITH_K=_V_WITH_K, num_warps=_NUM_WARPS, **common,
            **launch_options(dev),
        )
        if shared is not None:
            from .cascade_attention import launch_shared_prefix_pass  # imports this module's kernels

            launch_shared_prefix_pass(q, pay, sc, pool, layer, meta, group, qk_scale, part_acc, part_ml,
                                      first_slot=num_splits, common=common)
        if slots > 1:
            _decode_reduce_kernel[(bsz, hq)](
                part_acc, part_ml, out, out.stride(0), out.stride(1), hq, dim,
                NUM_SPLITS=slots, BLOCK_S=triton.next_power_of_2(slots), BLOCK_D=block_d, **launch_options(dev),
            )
    return out


# --------------------------------------------------------------------------------------------- backend


class PagedKVBackend:
    """`AttentionBackend` over the paged pool for one step: store the new K/V, then attend through the pool:
    the decode kernel when every sequence adds one token, else the paged prefill kernel (`prefill_kernel`,
    default on), where Triton applies; the reference otherwise."""

    def __init__(self, pool: KVPool, meta: PagedAttentionMetadata, scale: float | None = None, *,
                 use_triton: bool | None = None, prefill_kernel: bool = True, prefill_launch=None,
                 prefill_splits: int | None = None):
        """`prefill_launch` / `prefill_splits`: a caller-owned launch and a fixed key-split count (a CUDA graph's
        static buffers); by default the first layer builds the launch from `meta` and the split count follows
        the step's shape."""
        self.pool = pool
        self.meta = meta
        self.scale = scale
        self.use_triton = use_triton
        self.prefill_kernel = prefill_kernel
        self._prefill_launch = prefill_launch  # else built by the first layer, reused by the others
        self._prefill_splits = prefill_splits

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _check_attention_inputs(q, self.pool, layer_idx, self.meta)  # before anything is written
        write_kv(self.pool, layer_idx, self.meta.slot_mapping, k, v, use_triton=self.use_triton)
        return self._attend_written(layer_idx, q)

    def attend_unrotated(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                         sin: torch.Tensor) -> torch.Tensor:
        """`attend` for q and k before their per-head RMSNorm and rope: with the Triton kernels the norm, the rope
        and the K/V write are one launch (`qk_norm_rope_write_kv`, the same bytes as the two it replaces)."""
        if not _want_triton(self.pool.device, self.use_triton):
            q, k = qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)
            return self.attend(layer_idx, q, k, v)
        _check_attention_inputs(q, self.pool, layer_idx, self.meta)
        q = qk_norm_rope_write_kv(q, k, v, q_weight, k_weight, eps, cos, sin, self.pool, layer_idx,
                                  self.meta.slot_mapping)
        return self._attend_written(layer_idx, q)

    def _attend_written(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of the step's rotated q once its K/V are in the pool."""
        kernels = _want_triton(self.pool.device, self.use_triton)
        if self.meta.is_decode and kernels:
            return paged_decode_attention(q, self.pool, layer_idx, self.meta, self.scale, use_triton=True)
        if self.prefill_kernel and kernels:
            from . import paged_prefill  # imports this module's kernels: bound at first use

            if self._prefill_launch is None:
                group = q.shape[1] // self.pool.layout.num_kv_heads
                self._prefill_launch = paged_prefill.PrefillLaunch(
                    self.meta.query_lens, self.meta.context_lens_host, group, self.pool.device)
            return paged_prefill.paged_prefill_attention(q, self.pool, layer_idx, self.meta, self.scale,
                                                         launch=self._prefill_launch, use_triton=True,
                                                         num_splits=self._prefill_splits)
        return paged_attention_reference(q, self.pool, layer_idx, self.meta, self.scale)
