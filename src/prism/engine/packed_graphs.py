"""CUDA-graph packed steps: the eager packed forward (prefill chunks, questions, decodes, media tokens)
captured once per token-count bucket and replayed.

Owns replaying a *mixed* step without per-kernel launch overhead. On the H200's host an eager forward of the
8B decoder costs ~25-45 ms of Python and launches whatever its size, while a 256-token chunk beside 8 decodes
is ~14 ms of GPU work: interleaved chunks, the questions of a decision, and the mixed steps of many clients
were host-bound. One-token rows (`cuda_graphs.RowGraphs`) cannot take them: as rows each token re-reads its
whole context, and media tokens have no place there.

How a packed step fits a static graph:
- Every per-token input (token id, M-RoPE positions, slot, "is a media token") and every per-sequence input
  (context length, block table) and the prefill kernel's block list live in static buffers, refilled before
  replay. The kernel's grid covers the most blocks a bucket's pieces can make; unused entries hold zero tokens
  and exit.
- A bucket larger than the step is filled by one *padding sequence* whose tokens write scratch KV slots that
  no sequence owns and attend only to themselves; their logits are never read.
- Media features enter densely: a [tokens, hidden] buffer selected where the token is a media token, and
  DeepStack features as a [levels, tokens, hidden] buffer that holds zeros at text tokens (adding zero
  changes no value: the same sums as the eager forward's indexed add).
- The split count of the prefill kernel's keys is fixed per bucket (the kernel reads every real length from
  the device), so a row's arithmetic does not depend on which other rows share the step.
On a CPU pool nothing is captured and the same buffers run eagerly with the step's real lengths (how the CPU
tests put the packing through the whole engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kv.fp8 import KVPool
from ..model.qwen3_vl import DenseMultimodal, MultimodalEmbeddings, Qwen3VLModel
from ..ops import paged_prefill
from ..ops.attention_metadata import PagedAttentionMetadata
from ..ops.host_copy import copy_into
from ..ops.paged_attention import PagedKVBackend
from .cuda_graphs import capture_buckets, destroy_graphs, page_table

# A step replays its bucket's whole size, padding rows included (a step of 598 chunk tokens and 8 decodes took
# 18.4 ms in the 768 bucket on the H200, 16.2 in the 640 one), so the buckets are 64 tokens apart up to 1024.
BUCKETS = (32, 64, 128, *range(192, 1024 + 1, 64), 1536, 2048)
# Rows of the packed per-token host inputs: token id, 3 M-RoPE positions, slot, is-a-media-token.
_ID, _POS, _SLOT, _MEDIA = 0, slice(1, 4), 4, 5


@dataclass(frozen=True)
class PackedStep:
    """A step as packed pieces: piece i is tokens [starts[i], starts[i] + query_lens[i]) of the batch, its
    sequence's context after the step is context_lens[i], its pages `tables[i]`. `sample_rows` are the rows
    whose logits the step returns, in order; `media_rows` the rows that are media tokens."""

    token_ids: np.ndarray  # [n] int64
    positions: np.ndarray  # [3, n] int64
    slots: np.ndarray  # [n] int64
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    tables: list[list[int]]
    sample_rows: list[int]
    media_rows: np.ndarray  # [m] int64

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_pieces(cls, pieces, media, page_size: int) -> PackedStep:
        """From `step_payload.PieceInput`s and their `MediaSlice`s. A piece's filler rows (a deterministic tile's
        `pad`) are rows of its own sequence (id 0, the positions and slots after its end) and count in its query
        and context lengths, as in the eager forward; it samples its last real row."""
        ids, slots, positions, sample = [], [], [], []
        offset = 0
        for p in pieces:
            ids.append(np.asarray(p.token_ids, dtype=np.int64))
            if p.pad:  # filler ids right after the piece's own: `ids` is concatenated in this order
                ids.append(np.zeros(p.pad, dtype=np.int64))
            slots.append(p.slots(page_size))
            positions.append(p.positions.numpy())
            offset += p.num_rows
            if p.sample:
                sample.append(offset - p.pad - 1)
        media_rows = [np.arange(m.row, m.row + m.length, dtype=np.int64) for m in media]
        cat = np.concatenate
        return cls(cat(ids), cat(positions, axis=1), cat(slots), tuple(p.num_rows for p in pieces),
                   tuple(p.end + p.pad for p in pieces), [list(p.pages) for p in pieces], sample,
                   cat(media_rows) if media_rows else np.zeros(0, dtype=np.int64))


class PackedGraphs:
    def __init__(self, model: Qwen3VLModel, pool: KVPool, first_scratch_page: int, max_tokens: int,
                 max_seqs: int, max_model_len: int, buckets: tuple[int, ...] | None = None) -> None:
        """`buckets`: the token counts captured (default: `BUCKETS` below `max_tokens`, then `max_tokens`); a step
        replays the smallest that holds it."""
        self.model = model
        self.pool = pool
        page_size = pool.layout.page_size
        self.page_size = page_size
        self.max_pages = -(-max_model_len // page_size)
        self.max_context = self.max_pages * page_size
        max_tokens = min(max_tokens, self.max_context)
        if buckets is not None and (not buckets or min(buckets) < 1 or max(buckets) > max_tokens):
            raise ValueError(f"buckets must be in [1, {max_tokens}], got {buckets}")
        self.buckets = (tuple(sorted(buckets)) if buckets is not None
                        else tuple(b for b in BUCKETS if b < max_tokens) + (max_tokens,))
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs  # real sequences; slot max_seqs is the padding sequence
        text = model.config.text
        self.group = text.num_attention_heads // text.num_key_value_heads
        self.tokens_per_block = paged_prefill.tokens_per_block(self.group)
        self.scratch_slots = np.arange(max_tokens, dtype=np.int64) + first_scratch_page * page_size
        self.scratch_pages = list(range(first_scratch_page, first_scratch_page + -(-max_tokens // page_size)))
        dev, i64 = pool.device, torch.int64
        seqs = max_seqs + 1
        self.token_inputs = torch.zeros((6, max_tokens), dtype=i64, device=dev)
        self.context_lens = torch.ones(seqs, dtype=i64, device=dev)
        self.block_table = torch.zeros((seqs, self.max_pages), dtype=i64, device=dev)
        self.blocks = torch.zeros((self.num_blocks(max_tokens), 4), dtype=i64, device=dev)
        self.logits_index = torch.zeros(seqs, dtype=i64, device=dev)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=i64, device=dev)  # not read by the prefill kernel
        hidden, levels = text.hidden_size, len(model.config.vision.deepstack_visual_indexes)
        self.media_embeds = torch.zeros((max_tokens, hidden), dtype=model.dtype, device=dev)
        self.media_deepstack = torch.zeros((levels, max_tokens, hidden), dtype=model.dtype, device=dev)
        self._deepstack_dirty = 0  # leading rows of media_deepstack that may hold nonzero features
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.released = False

    def num_blocks(self, bucket: int) -> int:
        """The prefill kernel's grid for a bucket: the most query blocks its pieces can cut into (each piece,
        the padding one included, adds at most one partial block)."""
        return -(-bucket // self.tokens_per_block) + min(self.max_seqs + 1, bucket)

    def splits(self, bucket: int) -> int:
        """The prefill kernel's key splits for a bucket: as for one sequence of `bucket` new tokens at the
        longest context (many short pieces then get more splits than they need; never a different result)."""
        text = self.model.config.text
        blocks = -(-bucket // self.tokens_per_block)
        return paged_prefill.prefill_num_splits(bucket, blocks, self.group * self.pool.layout.num_kv_heads,
                                                self.pool.layout.num_kv_heads, text.head_dim, self.max_context)

    def _forward(self, bucket: int, real: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> torch.Tensor:
        """The step over the first `bucket` token rows. Captured (`real` None): host facts that pass the
        metadata's checks (one sequence of `bucket` tokens at the longest context); the kernels read the real
        ones from the device. Eager: `real` = (query lengths, context lengths) incl. the padding piece."""
        if real is None:  # the kernels index every sequence slot of the full buffers through `blocks`
            query_lens, context_lens = (bucket,), (self.max_context,)
        else:
            query_lens, context_lens = real
        seqs = len(query_lens)
        meta = PagedAttentionMetadata(
            self.query_start_loc[: seqs + 1], self.context_lens[:seqs], self.block_table[:seqs],
            self.token_inputs[_SLOT, :bucket], query_lens, context_lens, self.page_size,
            self.pool.layout.num_pages - 1)
        launch = paged_prefill.PrefillLaunch.static(self.group, self.blocks[: self.num_blocks(bucket)])
        backend = PagedKVBackend(self.pool, meta, prefill_launch=launch, prefill_splits=self.splits(bucket))
        media = DenseMultimodal(self.token_inputs[_MEDIA, :bucket] != 0, self.media_embeds[:bucket],
                                self.media_deepstack[:, :bucket])
        return self.model(self.token_inputs[_ID, :bucket], self.token_inputs[_POS, :bucket], backend,
                          multimodal=media, logits_indices=self.logits_index)

    def capture(self) -> None:
        """Capture every bucket, each over a step of padding only (valid inputs for the warm-up runs); nothing
        on a CPU pool."""
        self._graphs, self._outputs = capture_buckets(
            self.pool.device, self.buckets, self._forward, lambda b: self._fill(self._idle_step(), None, bucket=b))

    def release(self) -> None:
        """Destroy every captured bucket (`cuda_graphs.destroy_graphs`); a later step runs eagerly."""
        destroy_graphs(self._graphs, self._outputs)
        self.released = True  # (deterministic mode keeps the holder for its buffers: `testing.group_exit` asks this)

    def _idle_step(self) -> PackedStep:
        return PackedStep(np.zeros(0, np.int64), np.zeros((3, 0), np.int64), np.zeros(0, np.int64), (), (), [],
                          [], np.zeros(0, np.int64))

    def fits(self, num_tokens: int, num_seqs: int, max_context: int) -> bool:
        return 0 < num_tokens <= self.max_tokens and num_seqs <= self.max_seqs and max_context <= self.max_context

    def _fill(self, step: PackedStep, multimodal: MultimodalEmbeddings | None, bucket: int | None = None
              ) -> tuple[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Write the step into the buffers, padded to its bucket; (bucket, real lengths incl. the padding piece)."""
        n = step.num_tokens
        b = bucket or next(size for size in self.buckets if size >= n)
        pad = b - n
        query_lens, context_lens = step.query_lens, step.context_lens
        tables = list(step.tables)
        host = np.zeros((6, b), dtype=np.int64)
        host[_ID, :n] = step.token_ids
        host[_POS, :n] = step.positions
        host[_SLOT, :n] = step.slots
        host[_MEDIA, step.media_rows] = 1
        if pad:  # the padding sequence: positions 0..pad-1 in scratch slots, attending to themselves
            host[_SLOT, n:] = self.scratch_slots[:pad]
            query_lens, context_lens = (*query_lens, pad), (*context_lens, pad)
            tables.append(self.scratch_pages)
        seqs = len(query_lens)
        table = page_table(tables, self.max_pages)
        blocks = np.zeros((self.num_blocks(b), 4), dtype=np.int64)  # entries of zero tokens do nothing
        real_blocks = paged_prefill.prefill_blocks(query_lens, context_lens, self.tokens_per_block).numpy()
        blocks[: len(real_blocks)] = real_blocks
        logits_index = np.zeros(self.max_seqs + 1, dtype=np.int64)
        logits_index[: len(step.sample_rows)] = step.sample_rows
        # Pinned staging: a pageable copy would make the host wait for the work queued before it (a vision
        # encoding in the same step, or a step still running).
        copy_into(self.token_inputs[:, :b], host)
        copy_into(self.context_lens[:seqs], np.asarray(context_lens, dtype=np.int64))
        copy_into(self.block_table[:seqs], table)
        copy_into(self.blocks[: len(blocks)], blocks)
        copy_into(self.logits_index, logits_index)
        if self._deepstack_dirty:
            self.media_deepstack[:, : self._deepstack_dirty].zero_()
            self._deepstack_dirty = 0
        if multimodal is not None and multimodal.token_index.numel():
            rows = multimodal.token_index
            self.media_embeds.index_copy_(0, rows, multimodal.embeds.to(self.media_embeds.dtype))
            if multimodal.deepstack.shape[0]:
                self.media_deepstack.index_copy_(1, rows, multimodal.deepstack.to(self.media_deepstack.dtype))
                self._deepstack_dirty = b
        return b, (query_lens, context_lens)

    @torch.inference_mode()
    def run(self, step: PackedStep, multimodal: MultimodalEmbeddings | None,
            token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One step; logits [len(step.sample_rows), vocab] in fp32. `token_ids` ([k], on the device): the input
        ids of the step's first k rows, which the host has not read (async scheduling: decode rows first)."""
        if not self.fits(step.num_tokens, len(step.query_lens), max(step.context_lens, default=0)):
            raise ValueError(f"{step.num_tokens} tokens of {len(step.query_lens)} sequences do not fit the "
                             "captured packed graphs")
        if token_ids is not None and token_ids.numel() > step.num_tokens:
            raise ValueError(f"{token_ids.numel()} device token ids for a step of {step.num_tokens} rows")
        b, real = self._fill(step, multimodal)
        if token_ids is not None:  # after the host ids' copy, on the same stream
            self.token_inputs[_ID, : token_ids.numel()].copy_(token_ids)
        if b in self._graphs:
            self._graphs[b].replay()
            self.replays += 1
            logits = self._outputs[b]
        else:
            logits = self._forward(b, real)
        # A copy, never a view of the graph's output (what `.float()` of fp32 logits would be): a deterministic step
        # replays the bucket once per tile and keeps every sampling tile's logits until the last one has run.
        return logits[: len(step.sample_rows)].to(torch.float32, copy=True)
