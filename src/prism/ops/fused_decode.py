"""A decode step's attention in one launch per decoder layer: Q/K RMSNorm + M-RoPE + the K/V write + the split
attention + the merge of the splits.

Owns: `qk_norm_rope_decode_attention` returns exactly the output, and leaves exactly the pool bytes, of
`qk_norm_rope_write_kv` followed by `paged_decode_attention` (the three launches it replaces: the norm/rope/write
kernel, the split attention, the merge), so hit == miss and HF parity carry over unchanged. Each program of the
split attention (sequence, KV head, context split) norms and rotates its GQA group's query heads in registers (the
same helper and roundings as the unfused kernel, which stores them and reads them back); the one program whose
split holds the new token also norms, rotates and quantizes that token's key and value of its KV head into the
pool, then reads its keys back *through the pool* like every other key (invariant 4's read half: attention always
reads the pool, even for this step's tokens). The merge is done by whichever split program of a (sequence, KV
head) arrives last, counted by an arrival counter: it merges the splits in split order with the merge kernel's own
code, so the output does not depend on which program came last, and resets the counter to zero for the next launch.

Why: at batch 1 the two kernels this removes per layer are latency-bound (H200, W3: norm/rope/write 2.5 us and the
merge 1.9 us, each also a kernel boundary), 36 layers per step. Only decode steps without cascade attention's
shared prefix come here (the cascade pass has its own programs and slots), with a power-of-two head dim.

Memory ordering of the arrival: every thread's partial stores, a CTA barrier, then one acq_rel atomic at GPU scope
(the release publishes what the barrier ordered before it); the last arrival's acquire orders its reads of the
other programs' partials, which bypass L1 (`.cg`: another SM wrote them). The counters (`_arrival_counters`, one
zeroed int32 per (sequence, KV head), per device) are allocated outside any CUDA-graph capture and only ever
return to zero; launches on one device are assumed to be ordered (one stream), as all of a runner's are.
"""

from __future__ import annotations

import math

import torch

from ..kv.fp8 import KVPool
from . import kv_write
from . import paged_attention as pa
from .attention_metadata import PagedAttentionMetadata
from .fused_norms import check_rope_heads
from .kv_write import HAVE_TRITON, device_context
from .pdl import launch_options

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .fused_norms import _TL_DTYPE, norm_rope_values
    from .kv_write import _write_one, write_head_halves
    from .paged_attention import _attend_tile, _store_attention, fold_tile, load_tile
    from .pdl import wait_for_predecessors

# Off: the unfused launches (`bench/config_ab.py --variants 'fused_decode.ENABLED=false;...'`).
ENABLED = True
# Warps per program: the first key tile held in registers beside the q arithmetic needs 230 registers a thread at 8
# warps; at 4 (the split kernel's) ptxas spills (`bench/kernel_resources.py`).
NUM_WARPS = 8
# Counters allocated at a device's first launch; a launch needing more (sequences x KV heads) takes the unfused
# path rather than allocate inside a graph capture.
_COUNTERS_PER_DEVICE = 8192
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # a tensor allocated here would belong to the graph's pool
        counters = _COUNTERS[device] = torch.zeros(_COUNTERS_PER_DEVICE, dtype=torch.int32, device=device)
    return counters if needed <= counters.numel() else None


if HAVE_TRITON:

    @triton.jit
    def _merge_group(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, b, h0, GROUP, HQ,
                     NUM_SPLITS: tl.constexpr, BLOCK_GM: tl.constexpr, BLOCK_S: tl.constexpr,
                     HEAD_DIM: tl.constexpr):
        """`paged_attention.merge_splits` for the GROUP heads h0.. of row b at once ([heads, splits, dim] tiles: one
        round of loads, not one per head), the partials read past L1 (other programs of this launch wrote them)."""
        g = tl.arange(0, BLOCK_GM)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, HEAD_DIM)
        gmask = g < GROUP
        mask = gmask[:, None] & (s < NUM_SPLITS)[None, :]
        base = ((b.to(tl.int64) * HQ + h0 + g) * NUM_SPLITS)[:, None] + s[None, :]
        m = tl.load(part_ml_ptr + base * 2, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(part_ml_ptr + base * 2 + 1, mask=mask, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_acc_ptr + base[:, :, None] * HEAD_DIM + d[None, None, :], mask=mask[:, :, None], other=0.0,
                      cache_modifier=".cg")
        m_max = tl.max(m, axis=1)  # finite on real heads: split 0 always holds the row's first key
        w = tl.exp2(m - m_max[:, None])
        o = tl.sum(acc * w[:, :, None], axis=1) / tl.sum(l * w, axis=1)[:, None]
        optr = out_ptr + b.to(tl.int64) * stride_ot + (h0 + g).to(tl.int64)[:, None] * stride_oh + d[None, :]
        tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])

    @triton.jit(do_not_specialize=["stride_bt", "row_k", "row_v"])
    def _fused_decode_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slots_ptr, out_ptr, pay_ptr,
                             sc_ptr, bt_ptr, ctx_ptr, part_acc_ptr, part_ml_ptr, counter_ptr,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
                             stride_ot, stride_oh, stride_bt, eps, num_slots,
                             row_k, row_v, stride_row, stride_slot, sc_stride_row, page_size, qk_scale,
                             H, HQ, GROUP, HALF: tl.constexpr, DTYPE: tl.constexpr,
                             KIND: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_GM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                             PRECISION: tl.constexpr, OFFSET_DTYPE: tl.constexpr, NUM_STAGES: tl.constexpr,
                             NATIVE_FP8: tl.constexpr, V_WITH_K: tl.constexpr, PDL: tl.constexpr):
        # grid = (sequences, KV heads, splits), as `_decode_kernel` (no shared prefix); q, k, v: the step's rows
        # before their norm and rope.
        wait_for_predecessors(PDL)
        HEAD_DIM: tl.constexpr = 2 * HALF
        b = tl.program_id(0)
        hk = tl.program_id(1)
        split = tl.program_id(2)
        bl = b.to(tl.int64)
        ctx = tl.load(ctx_ptr + b).to(tl.int32)
        split_len = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, ctx)
        cos_row, sin_row = cos_ptr + bl * stride_cs, sin_ptr + bl * stride_cs
        if (lo <= ctx - 1) & (ctx - 1 < hi):  # this split holds the new token: its K/V of head hk into the pool
            slot = tl.load(slots_ptr + b)
            ok = (slot >= 0) & (slot < num_slots)  # as write_kv: a slot outside the pool is skipped
            k1, k2, h1, j1 = norm_rope_values(k_ptr + bl * stride_kt + hk.to(tl.int64) * stride_kh, stride_kh, kw_ptr,
                                              cos_row, sin_row, 1, eps, HALF, 1, DTYPE)
            write_head_halves(k1, k2, pay_ptr, sc_ptr, slot, ok, row_k, h1 + hk, j1, H, HALF, stride_row,
                              stride_slot, sc_stride_row, KIND, OFFSET_DTYPE)
            _write_one(v_ptr, stride_vt, stride_vh, 1, pay_ptr, sc_ptr, b, slot, ok, row_v,
                       hk + tl.arange(0, 1), tl.arange(0, HEAD_DIM), H, HEAD_DIM, stride_row, stride_slot,
                       sc_stride_row, KIND, OFFSET_DTYPE)
            tl.debug_barrier()  # the writes visible to every thread of this program before the keys are read
        d = tl.arange(0, HEAD_DIM)
        dmask = d < HEAD_DIM
        bt_row = bt_ptr + bl * stride_bt
        # The first key tile's loads are issued before the q arithmetic, so their latency (a page id, then K and V)
        # overlaps it; then the tile is folded in and the loop takes the rest, as `_attend_keys` would.
        pos, pmask, slot0, k, k_f, v, v_f = load_tile(lo, hi, bt_row, pay_ptr, sc_ptr, row_k, row_v, hk, d, dmask,
                                                      stride_row, stride_slot, sc_stride_row, page_size, H,
                                                      HEAD_DIM, BLOCK_N, KIND, DOT_DTYPE, OFFSET_DTYPE, NATIVE_FP8,
                                                      V_WITH_K, True)
        q1, q2, g, j = norm_rope_values(q_ptr + bl * stride_qt + (hk * GROUP).to(tl.int64) * stride_qh, stride_qh,
                                        qw_ptr, cos_row, sin_row, GROUP, eps, HALF, BLOCK_G, DTYPE)
        q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_G, HEAD_DIM))  # the halves side by side
        q = (q * qk_scale).to(DOT_DTYPE)
        gmask = g < GROUP
        qh = hk * GROUP + g
        qpos = tl.zeros([BLOCK_G], tl.int32) + (ctx - 1)  # the new token: it sees its whole context
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        m_i, l_i, acc = fold_tile(q, qpos, pos, pmask, slot0, k, k_f, v, v_f, m_i, l_i, acc, pay_ptr, sc_ptr, row_v,
                                  hk, d, dmask, stride_row, stride_slot, sc_stride_row, H, HEAD_DIM, KIND, DOT_DTYPE,
                                  PRECISION, OFFSET_DTYPE, NATIVE_FP8, V_WITH_K, True)
        for n0 in tl.range(lo + BLOCK_N, hi, BLOCK_N, num_stages=NUM_STAGES):
            m_i, l_i, acc = _attend_tile(q, qpos, n0, hi, m_i, l_i, acc, bt_row, pay_ptr, sc_ptr, row_k, row_v, hk,
                                         d, dmask, stride_row, stride_slot, sc_stride_row, page_size, H, HEAD_DIM,
                                         BLOCK_N, KIND, DOT_DTYPE, PRECISION, OFFSET_DTYPE, NATIVE_FP8, V_WITH_K,
                                         True)
        _store_attention(m_i, l_i, acc, tl.zeros([BLOCK_G], tl.int32) + b, qh, gmask, d, dmask, out_ptr,
                         stride_ot, stride_oh, part_acc_ptr, part_ml_ptr, split, HQ, HEAD_DIM, NUM_SPLITS)
        if NUM_SPLITS > 1:
            tl.debug_barrier()  # every thread's partials stored before the arrival is counted
            counter = counter_ptr + bl * H + hk
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:  # the last split of (b, hk) to finish merges the group's heads
                _merge_group(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, b, hk * GROUP, GROUP, HQ,
                             NUM_SPLITS, BLOCK_GM, BLOCK_S, HEAD_DIM)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def takes_fused_decode(q: torch.Tensor, pool: KVPool, meta: PagedAttentionMetadata) -> bool:
    """Whether `qk_norm_rope_decode_attention` applies: `ENABLED`, a decode step without a shared prefix, a
    power-of-two head dim (the halves are joined in registers), on a Triton device."""
    d = q.shape[-1]
    return (ENABLED and HAVE_TRITON and meta.is_decode and meta.shared_prefix is None and d >= 2
            and d & (d - 1) == 0 and q.shape[0] == meta.num_seqs)


def qk_norm_rope_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                                  k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                                  pool: KVPool, layer: int, meta: PagedAttentionMetadata,
                                  scale: float | None = None, *, num_splits: int | None = None
                                  ) -> torch.Tensor | None:
    """q [B, Hq, D] and k, v [B, Hkv, D] of a decode step, before their per-head norm and rope (views of the fused
    qkv output are fine) -> the attention output [B, Hq, D]; the step's K/V are written to `meta.slot_mapping`.
    Returns None, having done nothing, where it does not apply (`takes_fused_decode`, or no arrival counters:
    more sequences x KV heads than `_COUNTERS_PER_DEVICE`, or a first launch inside a capture): the caller runs the
    unfused launches, which compute the same bytes."""
    if not takes_fused_decode(q, pool, meta):
        return None
    group, pay, sc = pa.kernel_operands(q, pool, layer, meta)
    kv_write._check_write_inputs(pool, layer, meta.slot_mapping, k, v)
    check_rope_heads("qk_norm_rope_decode_attention", q, k, v)
    lay = pool.layout
    bsz, hq, dim = q.shape
    if num_splits is None:
        num_splits = pa.decode_num_splits(bsz, lay.num_kv_heads, meta.max_context_len)
    counters = _arrival_counters(pool.device, bsz * lay.num_kv_heads) if num_splits > 1 else pay
    if counters is None:
        return None
    qk_scale = (1.0 / math.sqrt(dim) if scale is None else float(scale)) * pa._LOG2E
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dev = pool.device
    if num_splits > 1:
        part_acc = torch.empty((bsz, hq, num_splits, dim), dtype=torch.float32, device=dev)
        part_ml = torch.empty((bsz, hq, num_splits, 2), dtype=torch.float32, device=dev)
    else:
        part_acc = part_ml = out  # unused placeholders
    cos, sin = cos.contiguous(), sin.contiguous()
    dot, precision = pa.dot_dtype(q.dtype, lay.kv_dtype)
    with device_context(dev):
        _fused_decode_kernel[(bsz, lay.num_kv_heads, num_splits)](
            q, k, v, q_weight, k_weight, cos, sin, meta.slot_mapping, out, pay, sc, meta.block_table,
            meta.context_lens, part_acc, part_ml, counters,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            out.stride(0), out.stride(1), meta.block_table.stride(0), eps, lay.num_slots,
            layer, lay.num_layers + layer, *kv_write.row_strides(lay), lay.page_size, qk_scale,
            lay.num_kv_heads, hq, group, HALF=dim // 2, DTYPE=_TL_DTYPE[q.dtype], KIND=kv_write._KINDS[lay.kv_dtype],
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_GM=triton.next_power_of_2(group),
            BLOCK_N=pa._BLOCK_N, DOT_DTYPE=dot, PRECISION=precision,
            OFFSET_DTYPE=kv_write._OFFSET_DTYPE, NUM_STAGES=pa._NUM_STAGES, NATIVE_FP8=pa.native_fp8(dev),
            V_WITH_K=pa._V_WITH_K, num_warps=NUM_WARPS, **launch_options(dev),
        )
    return out
