"""Cascade decode attention: the pages that many sequences share are read once for all of them.

Owns "a shared prefix is read once per step". When many sequences continue the same cached prefix (the same
images), the per-sequence decode kernel has every sequence's programs load and decode the same pages again:
at batch 32 over an 8-image prefix that is most of a decode step's attention. Here a decode step runs in
three launches:

1. `_shared_prefix_kernel`: the keys that a row shares with the *leader* row (the same physical pages at the
   start of both block tables) are attended by all such rows together, whose (sequence, query head) pairs are
   the rows of the `tl.dot` tiles, so one tile load serves every sequence;
2. the decode kernel with `SKIP_PREFIX`: each sequence's own remaining keys;
3. the split reduce, which merges both kinds of partial softmax.

`paged_decode_attention` makes all three launches when the step's metadata carries a `SharedPrefix`; this
module owns the host plan and the shared pass (`launch_shared_prefix_pass`).

It is the same attention as `paged_decode_attention`, rounded differently (like another split count). Which
rows share what is decided on the host from the block tables (`plan_shared_prefix`); the device only reads
`SharedPrefix`, so a CUDA graph captured once serves any sharing pattern (a row that shares nothing has prefix
0 and attends all its keys in the decode kernel).
"""

from __future__ import annotations

import numpy as np
import torch

from ..kv.fp8 import KVPool
from . import kv_write
from .attention_metadata import PagedAttentionMetadata
from .kv_write import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .paged_attention import _attend_keys, _store_attention

# Shared pass knobs (`bench/tune_decode_attention.py --cascade` sweeps them on the GPU): (sequence, head) rows
# per program, keys per tile, the programs that split one row block's shared keys, warps per program, pipeline
# depth of the key loop, V loaded beside K (`paged_attention._attend_keys`).
# H200 sweep (2026-11-29, 8B shapes, FP8 pages of 256, 6 shared pages + one own, `-tune-cascade.txt`), us per
# layer against the plain decode kernel: batch 32 42.7 -> 24.4, batch 8 19.1 -> 14.8 (both at 16 splits).
# In the engine since (session 23, W3 steps, five samples each, none overlapping at batch 32): 8 splits against 16,
# batch 32 5.54 vs 5.58 ms, batch 8 5.20 vs 5.21, batch 1 (no shared pass) equal.
BLOCK_M = 64
BLOCK_N = 128
SPLITS = 8
NUM_WARPS = 4
NUM_STAGES = 2
V_WITH_K = True
# fp32 queries on the GPU (exact "ieee" products, the tests): the 128-key tiles' fp32 operands do not fit the
# shared memory (as in `paged_prefill`), so smaller tiles without pipelining.
BLOCK_N_IEEE_CUDA = 64
# Rows tried as the leader per step (those with the most full pages first): bounds the host's search, which
# compares every candidate's pages with every row's.
MAX_LEADER_CANDIDATES = 16
# The shared pass runs only if it spares at least this fraction of the step's key reads. H200 sweep: the extra
# pass and merge cost ~9 us per layer at batch 32 when nothing is shared (56.4 -> 65.0 us) and saved 18 us when
# 31 of 32 rows shared 90% of their keys; a conservative line between the two, not itself swept.
MIN_SAVED_FRACTION = 0.25


def plan_shared_prefix(table: np.ndarray, context_lens: np.ndarray, page_size: int) -> tuple[int, np.ndarray]:
    """(leader row, prefix_lens [n] int64) for a decode step's rows: `table` [n, width] their physical pages in
    logical order (zero-padded), `context_lens` [n] their contexts including the new token.

    A row's prefix is the run of leading pages it holds in common with the leader, in whole pages, cut before
    the page that holds its new token and before the leader's (so every row keeps at least its new token for
    the decode kernel, and no padding column is ever compared as a page); the leader's own prefix is the
    longest any other row shares. The leader is the candidate whose prefixes spare the most key reads (each
    other row's prefix is read once, by the shared pass, instead of once more by that row). All zeros when the
    best leader spares less than `MIN_SAVED_FRACTION` of the step's key reads: the step then runs without the
    shared pass."""
    n = len(context_lens)
    ctx = np.asarray(context_lens, dtype=np.int64)
    none = np.zeros(n, dtype=np.int64)
    full = (ctx - 1) // page_size  # full pages before each row's new token
    eligible = np.flatnonzero(full > 0)
    if len(eligible) < 2:
        return 0, none
    cands = eligible[np.argsort(-full[eligible], kind="stable")[:MAX_LEADER_CANDIDATES]]
    pages_of = table[:, : int(full.max())]
    same = np.logical_and.accumulate(pages_of[cands][:, None, :] == pages_of[None, :, :], axis=2)
    shared = np.minimum(np.minimum(same.sum(axis=2), full[None, :]), full[cands][:, None])  # [candidate, row]
    shared[np.arange(len(cands)), cands] = 0
    best = int(shared.sum(axis=1).argmax())
    if shared[best].sum() * page_size < MIN_SAVED_FRACTION * ctx.sum():
        return 0, none
    leader, pages = int(cands[best]), shared[best]
    pages[leader] = pages.max()  # the leader's own pages past what any other row shares stay in its own pass
    return leader, pages.astype(np.int64) * page_size


def check_shared_prefix_plan(table: np.ndarray, context_lens: np.ndarray, page_size: int, leader: int,
                             prefix_lens: np.ndarray) -> None:
    """ValueError unless the plan claims, for each row, whole pages below its new token that its table and the
    leader's hold alike (what makes the shared pass read exactly the keys the row would have read). The engine
    runs it on every plan when `check_invariants` is set; the device cannot check it without a sync."""
    n = len(context_lens)
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    if prefix.shape != (n,) or (prefix < 0).any() or (prefix % page_size).any():
        raise ValueError(f"cascade plan: prefixes {prefix.tolist()} are not whole pages of {n} rows")
    below = (np.asarray(context_lens, dtype=np.int64) - 1) // page_size * page_size
    if (prefix > below).any():
        raise ValueError(f"cascade plan: prefixes {prefix.tolist()} reach the pages of new tokens (contexts "
                         f"{np.asarray(context_lens).tolist()})")
    if not prefix.any():
        return
    if not 0 <= leader < n:
        raise ValueError(f"cascade plan: leader {leader} is not one of the {n} rows")
    width = int(prefix.max()) // page_size
    claimed = np.arange(width)[None, :] < (prefix // page_size)[:, None]
    differ = (table[:, :width] != table[leader, :width]) & claimed
    if differ.any():
        raise ValueError(f"cascade plan: row {int(differ.any(axis=1).argmax())} claims pages the leader "
                         f"(row {leader}) does not hold")


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["stride_bt", "row_k", "row_v"])
    def _shared_prefix_kernel(q_ptr, pay_ptr, sc_ptr, bt_ptr, prefix_ptr, leader_ptr, part_acc_ptr, part_ml_ptr,
                              stride_qt, stride_qh, stride_bt, row_k, row_v, stride_row, stride_slot,
                              sc_stride_row, page_size, qk_scale, B, H, HQ, GROUP, HEAD_DIM,
                              KIND: tl.constexpr, SPLITS: tl.constexpr, FIRST_SLOT: tl.constexpr,
                              SPLIT_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                              OFFSET_DTYPE: tl.constexpr, NUM_STAGES: tl.constexpr, NATIVE_FP8: tl.constexpr,
                              V_WITH_K: tl.constexpr):
        # grid = (KV heads, row blocks, splits). Row r of a block is query head r % GROUP of KV head hk in
        # sequence r // GROUP; it sees the leader's keys [0, prefix[seq]) (a row with prefix 0 sees none, and
        # its partial is m = -inf, l = 0, which the reduce weighs 0). The splits divide the block's longest
        # prefix in whole tiles; partials go to slots FIRST_SLOT + split of SPLIT_SLOTS per (token, head).
        hk = tl.program_id(0)
        r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        split = tl.program_id(2)
        seq = r // GROUP
        head = hk * GROUP + r % GROUP
        rmask = seq < B
        prefix = tl.load(prefix_ptr + seq, mask=rmask, other=0).to(tl.int32)
        shared = tl.max(prefix, axis=0)
        split_len = tl.cdiv(tl.cdiv(shared, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, shared)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(q_ptr + seq[:, None].to(tl.int64) * stride_qt + head[:, None].to(tl.int64) * stride_qh
                    + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        q = (q.to(tl.float32) * qk_scale).to(DOT_DTYPE)
        bt_row = bt_ptr + tl.load(leader_ptr) * stride_bt
        m_i, l_i, acc = _attend_keys(q, prefix - 1, lo, lo, hi, bt_row, pay_ptr, sc_ptr, row_k, row_v, hk, d,
                                     dmask, stride_row, stride_slot, sc_stride_row, page_size, H, HEAD_DIM,
                                     BLOCK_M, BLOCK_N, BLOCK_D, KIND, DOT_DTYPE, PRECISION, OFFSET_DTYPE,
                                     NUM_STAGES, NATIVE_FP8, V_WITH_K, False)
        _store_attention(m_i, l_i, acc, seq, head, rmask, d, dmask, q_ptr, 0, 0, part_acc_ptr, part_ml_ptr,
                         FIRST_SLOT + split, HQ, HEAD_DIM, SPLIT_SLOTS)


def launch_shared_prefix_pass(q: torch.Tensor, pay: torch.Tensor, sc: torch.Tensor, pool: KVPool, layer: int,
                              meta: PagedAttentionMetadata, group: int, qk_scale: float, part_acc: torch.Tensor,
                              part_ml: torch.Tensor, *, first_slot: int, common: dict) -> None:
    """Launch `_shared_prefix_kernel` for `paged_decode_attention` (which checked the operands, launched the decode
    kernel over each row's own keys and merges the partials): its partial softmaxes go to slots
    `first_slot ...` of `part_acc` / `part_ml`. `common`: the launch constants both kernels share."""
    shared = meta.shared_prefix
    if shared is None or not meta.is_decode:
        raise ValueError("cascade attention needs a decode step with a shared prefix")
    lay = pool.layout
    bsz, hq, dim = q.shape
    block_m = min(BLOCK_M, max(16, triton.next_power_of_2(bsz * group)))
    ieee_cuda = common["PRECISION"] == "ieee" and pool.device.type == "cuda"
    block_n, stages = (BLOCK_N_IEEE_CUDA, 1) if ieee_cuda else (BLOCK_N, NUM_STAGES)
    _shared_prefix_kernel[(lay.num_kv_heads, triton.cdiv(bsz * group, block_m), shared.splits)](
        q, pay, sc, meta.block_table, shared.prefix_lens, shared.leader, part_acc, part_ml,
        q.stride(0), q.stride(1), meta.block_table.stride(0), layer, lay.num_layers + layer,
        *kv_write.row_strides(lay), lay.page_size, qk_scale, bsz, lay.num_kv_heads, hq, group, dim,
        SPLITS=shared.splits, FIRST_SLOT=first_slot, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=stages,
        V_WITH_K=V_WITH_K, num_warps=NUM_WARPS, **common,
    )
