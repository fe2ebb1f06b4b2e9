"""Prefill attention straight from the paged (FP8) pool: one Triton kernel, no dense temporary.

Owns: attention for steps whose sequences add several tokens (a prefill chunk, the question after a
prefix hit), reading every key and value through the pool like `paged_attention_reference` (the spec,
same causal alignment, same GQA) but without gathering and dequantizing the context into a dense
tensor per sequence per layer (the engine we come from could not avoid that copy). FP8 payloads are
decoded in registers and the per-token scales are applied to the score and probability columns.

Layout: the new tokens of each sequence are cut into blocks; one program serves one block and one KV
head, its rows being (token, query head of the GQA group) pairs, so each key tile is loaded once for the
whole group. A step with few blocks (a short question after a long cached prefix) also splits each
block's keys over programs and merges the partial softmaxes. For a given split count, each row's result
depends only on its own query, its own context, iterated in fixed tiles, and (on CUDA, through the unmasked
tiles, `_SPLIT_MASKED`) on where its block starts, i.e. on its own sequence's chunk start: nothing else in the
batch changes it. Deterministic mode's page-aligned tiles start every block at the same positions whether a
prefix was a hit or computed in the same step.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..kv.fp8 import KVPool
from . import kv_write
from .attention_metadata import PagedAttentionMetadata
from .host_copy import to_device
from .kv_write import HAVE_TRITON, _want_triton, device_context
from .paged_attention import (
    _MAX_SPLITS as _MAX_DECODE_SPLITS,
)
from .paged_attention import (
    kernel_operands,
    native_fp8,
    paged_attention_reference,
    paged_decode_attention,
    power_of_two_at_most,
)
from .pdl import launch_options

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .paged_attention import _attend_keys, _decode_reduce_kernel, _store_attention, dot_dtype

_LOG2E = 1.4426950408889634
# Launch knobs from the H200 sweep (`bench/tune_prefill_attention.py`): with 128-key tiles and no pipelining a
# 1,600-token prefill took 134 us per layer instead of 317, a 256-token chunk 34 instead of 72, a 30-token
# question over 1,630 cached tokens 16 instead of 30 (128-row programs and 8 warps were slower in every case).
_BLOCK_ROWS = 64  # rows (token, head) of one program
_BLOCK_N = 128  # keys per tile
# fp32 queries on the GPU (exact "ieee" products, unrolled into FMAs): LLVM did not finish emitting PTX for the
# 64-row x 128-key tile over a bf16 pool within minutes (H200, triton 3.6); half the keys per tile compile.
_BLOCK_N_IEEE_CUDA = 64
_NUM_WARPS = 4
_NUM_STAGES = 1  # software pipelining of the key loop
_TARGET_PROGRAMS = 512  # below this many (block, KV head) programs, split the keys too
_MAX_SPLITS = 8  # a packed graph's fixed grid: W2's question in bucket 32 took 25.8 us at 16 splits, 22.1 at 8
_MAX_PARTIAL_BYTES = 16 * 2**20
# A causal prefill's blocks differ in work: the last block of a 1,600-token prompt reads 13 key tiles, the first
# one. The blocks are listed heaviest first and a block's KV heads launched together, so the long programs
# start first and the short ones fill the tail (longest-processing-time-first), and the tiles every row of a
# block sees whole skip the causal mask. The order changes no row's numbers; the unmasked tiles can change the
# last bits on CUDA (FMA fusion, see `paged_attention._attend_keys`; found by review after the GPU runs). H200 sweep
# (`tune_prefill_attention.py --schedule`), us per layer: 1,600-token prefill 134 -> 102 (order 134 -> 107, the
# unmasked tiles 107 -> 102), W2's question 18.0 -> 16.1 (the unmasked tiles), a 256-token chunk 38 -> 35.
_HEAVIEST_FIRST = True
_HEADS_FASTEST = True
_SPLIT_MASKED = True
_V_WITH_K = False  # see `paged_attention._attend_keys`: with 64-row tiles it was slower (1,600-token prefill 134 -> 140 us)


def prefill_num_splits(num_tokens: int, num_blocks: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       max_context_len: int) -> int:
    """Key splits of a prefill launch: 1 when the blocks alone fill the device; more for a short question
    over a long cached context (the W2 shape), bounded by the partial buffers' size."""
    programs = num_blocks * num_kv_heads
    if programs >= _TARGET_PROGRAMS:
        return 1
    by_programs = -(-_TARGET_PROGRAMS // max(1, programs))
    by_keys = -(-max_context_len // _BLOCK_N)  # at least one key tile per split
    by_memory = _MAX_PARTIAL_BYTES // max(1, num_tokens * num_q_heads * (head_dim + 2) * 4)
    return power_of_two_at_most(max(1, min(by_programs, by_keys, by_memory, _MAX_SPLITS)))


def prefill_blocks(query_lens, context_lens, tokens_per_block: int) -> torch.Tensor:
    """Host int64 [num_blocks, 4]: (sequence, packed row of the block's first token, its absolute
    position, tokens in the block) for every block of `tokens_per_block` new tokens; with `_HEAVIEST_FIRST`
    ordered by the keys the block reads (its last position), most first, ties in packed order."""
    q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    c = np.asarray(context_lens, dtype=np.int64).reshape(-1)
    if q.shape != c.shape:
        raise ValueError(f"{len(q)} query lengths for {len(c)} context lengths")
    per_seq = -(-q // tokens_per_block)
    seq = np.repeat(np.arange(len(q), dtype=np.int64), per_seq)
    first_block = np.cumsum(per_seq) - per_seq
    offset = (np.arange(len(seq), dtype=np.int64) - first_block[seq]) * tokens_per_block  # within the sequence
    first_row = (np.cumsum(q) - q)[seq] + offset
    first_pos = (c - q)[seq] + offset
    count = np.minimum(tokens_per_block, q[seq] - offset)
    rows = np.stack([seq, first_row, first_pos, count], axis=1)
    if _HEAVIEST_FIRST:
        rows = rows[np.argsort(-(first_pos + count), kind="stable")]
    return torch.from_numpy(np.ascontiguousarray(rows))


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["stride_bt", "row_k", "row_v", "NUM_BLOCKS"])  # as the decode kernel: bounded variants
    def _prefill_kernel(q_ptr, out_ptr, pay_ptr, sc_ptr, bt_ptr, ctx_ptr, blocks_ptr,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                        row_k, row_v, stride_row, stride_slot, sc_stride_row, page_size, qk_scale,
                        part_acc_ptr, part_ml_ptr, H, HQ, GROUP, HEAD_DIM, NUM_BLOCKS,
                        KIND: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, OFFSET_DTYPE: tl.constexpr, NUM_STAGES: tl.constexpr,
                        NATIVE_FP8: tl.constexpr, V_WITH_K: tl.constexpr, SPLIT_MASKED: tl.constexpr,
                        HEADS_FASTEST: tl.constexpr):
        # grid = (blocks x KV heads, splits), the KV head varying fastest (HEADS_FASTEST) or slowest. Row r of
        # the tile is token r // GROUP of the block, query head r % GROUP. With several splits, each takes a
        # share of the block's keys (whole tiles) and writes a partial softmax that `_decode_reduce_kernel`
        # merges per (token, head).
        pid = tl.program_id(0)
        if HEADS_FASTEST:
            blk = pid // H
            hk = pid % H
        else:
            blk = pid % NUM_BLOCKS
            hk = pid // NUM_BLOCKS
        split = tl.program_id(1)
        seq = tl.load(blocks_ptr + blk * 4)
        first_row = tl.load(blocks_ptr + blk * 4 + 1)
        first_pos = tl.load(blocks_ptr + blk * 4 + 2)
        count = tl.load(blocks_ptr + blk * 4 + 3)
        if count == 0:  # an unused entry of a packed graph's fixed grid: it owns no row, so nothing to write
            return
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
        bt_row = bt_ptr + seq * stride_bt
        end = tl.minimum(first_pos + count, ctx)  # keys past the block's last token are masked for every row
        split_len = tl.cdiv(tl.cdiv(end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, end)
        # Keys <= first_pos are visible to every row of the block: whole tiles of them need no mask.
        full_hi = lo + tl.maximum(tl.minimum(first_pos + 1, hi) - lo, 0) // BLOCK_N * BLOCK_N
        m_i, l_i, acc = _attend_keys(q, qpos, lo, full_hi, hi, bt_row, pay_ptr, sc_ptr, row_k, row_v, hk, d,
                                     dmask, stride_row, stride_slot, sc_stride_row, page_size, H, HEAD_DIM,
                                     BLOCK_M, BLOCK_N, BLOCK_D, KIND, DOT_DTYPE, PRECISION, OFFSET_DTYPE,
                                     NUM_STAGES, NATIVE_FP8, V_WITH_K, SPLIT_MASKED)
        _store_attention(m_i, l_i, acc, q_rows, head, rmask, d, dmask, out_ptr, stride_ot, stride_oh,
                         part_acc_ptr, part_ml_ptr, split, HQ, HEAD_DIM, NUM_SPLITS)

def tokens_per_block(group: int) -> int:
    """New tokens per program of the prefill kernel for a GQA group of `group` query heads per KV head."""
    return max(1, _BLOCK_ROWS // triton.next_power_of_2(group)) if HAVE_TRITON else 1


class PrefillLaunch:
    """The per-step part of a prefill launch (the block table of the query blocks on the device), built
    once per step on the host and reused by every layer."""

    def __init__(self, query_lens, context_lens, group: int, device: torch.device):
        self.group = group
        self.tokens = tokens_per_block(group)
        self.blocks = to_device(prefill_blocks(query_lens, context_lens, self.tokens), device)

    @classmethod
    def static(cls, group: int, blocks: torch.Tensor) -> PrefillLaunch:
        """A launch over a caller-owned block buffer (a CUDA graph's): entries holding zero tokens do nothing."""
        launch = cls.__new__(cls)
        launch.group, launch.tokens, launch.blocks = group, tokens_per_block(group), blocks
        return launch


def paged_prefill_attention(q: torch.Tensor, pool: KVPool, layer: int, meta: PagedAttentionMetadata,
                            scale: float | None = None, *, launch: PrefillLaunch | None = None,
                            use_triton: bool | None = None, num_splits: int | None = None) -> torch.Tensor:
    """q [N, H_q, D] of any step -> [N, H_q, D]; the reference's result up to fp32 / dot rounding. Triton on
    CUDA (one launch, two with key splits), `paged_attention_reference` elsewhere unless forced.
    `num_splits` (default `prefill_num_splits`, which looks at the whole step) splits each block's keys; with
    it fixed, a row's result does not depend on the rest of the batch."""
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
    dot, precision = dot_dtype(q.dtype, lay.kv_dtype)
    block_n = _BLOCK_N_IEEE_CUDA if precision == "ieee" and pool.device.type == "cuda" else _BLOCK_N
    num_blocks = launch.blocks.shape[0]
    n, hq = q.shape[0], q.shape[1]
    if num_splits is None:
        num_splits = prefill_num_splits(n, num_blocks, hq, lay.num_kv_heads, dim, meta.max_context_len)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if num_splits > 1:
        part_acc = torch.empty((n, hq, num_splits, dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((n, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused placeholders
    with device_context(pool.device):
        _prefill_kernel[(num_blocks * lay.num_kv_heads, num_splits)](
            q, out, pay, sc, meta.block_table, meta.context_lens, launch.blocks,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_table.stride(0),
            layer, lay.num_layers + layer, *kv_write.row_strides(lay), lay.page_size, sm_scale * _LOG2E,
            part_acc, part_ml, lay.num_kv_heads, hq, group, dim, num_blocks,
            KIND=kv_write._KINDS[lay.kv_dtype], TOKENS=launch.tokens, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_D=block_d, DOT_DTYPE=dot, PRECISION=precision, NUM_SPLITS=num_splits,
            OFFSET_DTYPE=kv_write._OFFSET_DTYPE, NUM_STAGES=_NUM_STAGES, NATIVE_FP8=native_fp8(pool.device),
            V_WITH_K=_V_WITH_K, SPLIT_MASKED=_SPLIT_MASKED, HEADS_FASTEST=_HEADS_FASTEST, num_warps=_NUM_WARPS,
            num_stages=_NUM_STAGES,
        )
        if num_splits > 1:
            _decode_reduce_kernel[(n, hq)](
                part_acc, part_ml, out, out.stride(0), out.stride(1), hq, dim,
                NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
                **launch_options(pool.device),
            )
    return out


def compile_attention_variants(pool: KVPool, num_q_heads: int, dtype: torch.dtype) -> int:
    """JIT-compile every split-count variant of the decode and prefill kernels for this pool and q dtype now
    (engine start), not in the middle of serving. Reads page 0, writes nothing. Returns the launches made."""
    lay = pool.layout
    meta = PagedAttentionMetadata.build([1], [1], [[0]], lay.page_size, pool.device)  # valid for any page size
    q = torch.zeros(1, num_q_heads, lay.head_dim, dtype=dtype, device=pool.device)
    launches = 0
    splits = 1
    while splits <= _MAX_SPLITS:
        paged_prefill_attention(q, pool, 0, meta, num_splits=splits, use_triton=True)
        splits, launches = splits * 2, launches + 1
    splits = 1
    while splits <= _MAX_DECODE_SPLITS:
        paged_decode_attention(q, pool, 0, meta, num_splits=splits, use_triton=True)
        splits, launches = splits * 2, launches + 1
    return launches
