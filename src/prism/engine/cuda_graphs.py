"""CUDA-graph decode: one captured decode step per batch-size bucket.

Owns replaying the eager decode computation without per-kernel launch overhead. Every input of the
step (token ids, M-RoPE positions, slot mapping, context lengths, block table) lives in a static
buffer refilled in place before replay; the attention metadata's host facts are fixed per bucket (all
query lengths 1, the longest possible context, so the split-K shape never changes). A bucket larger
than the batch is padded with rows that write to scratch KV slots no sequence owns and read only
those; their logits are dropped.
"""

from __future__ import annotations

import torch

from ..kv.fp8 import KVPool
from ..model.qwen3_vl import Qwen3VLModel
from ..ops.paged_attention import PagedAttentionMetadata, PagedKVBackend

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(
        self,
        model: Qwen3VLModel,
        pool: KVPool,
        first_scratch_page: int,
        max_batch: int,
        max_model_len: int,
    ) -> None:
        if pool.device.type != "cuda":
            raise ValueError("CUDA graphs need the KV pool on a CUDA device")
        self.model = model
        self.pool = pool
        page_size = pool.layout.page_size
        self.page_size = page_size
        self.buckets = tuple(b for b in BUCKETS if b < max_batch) + (max_batch,)
        self.max_batch = max_batch
        self.max_pages = -(-max_model_len // page_size)
        self.max_context = self.max_pages * page_size
        dev = pool.device
        i64 = torch.int64
        # Padding row i of a bucket writes scratch slot i and reads it back (context length 1).
        self.scratch_slots = torch.arange(max_batch, dtype=i64, device=dev) + first_scratch_page * page_size
        scratch_pages = self.scratch_slots // page_size
        self.input_ids = torch.zeros(max_batch, dtype=i64, device=dev)
        self.positions = torch.zeros(3, max_batch, dtype=i64, device=dev)
        self.slot_mapping = self.scratch_slots.clone()
        self.context_lens = torch.ones(max_batch, dtype=i64, device=dev)
        self.block_table = scratch_pages[:, None].repeat(1, self.max_pages).contiguous()
        self.query_start_loc = torch.arange(max_batch + 1, dtype=i64, device=dev)
        self.logits_index = torch.arange(max_batch, dtype=i64, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _backend(self, b: int) -> PagedKVBackend:
        meta = PagedAttentionMetadata(
            self.query_start_loc[: b + 1],
            self.context_lens[:b],
            self.block_table[:b],
            self.slot_mapping[:b],
            (1,) * b,
            (self.max_context,) * b,
            self.page_size,
            self.pool.layout.num_pages - 1,
        )
        return PagedKVBackend(self.pool, meta)

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:b], self.positions[:, :b], self._backend(b), logits_indices=self.logits_index[:b]
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket (largest first, sharing one memory pool)."""
        memory = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compile Triton kernels and settle allocations outside the capture
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory):
                self._outputs[b] = self._forward(b)
            self._graphs[b] = graph
        torch.cuda.synchronize()

    def fits(self, num_seqs: int, max_context: int) -> bool:
        return 0 < num_seqs <= self.max_batch and max_context <= self.max_context

    @torch.inference_mode()
    def run(
        self, token_ids: list[int], positions: torch.Tensor, slots: list[int], context_lens: list[int],
        page_tables: list[list[int]],
    ) -> torch.Tensor:
        """One decode step for n sequences (one new token each); logits [n, vocab] in fp32."""
        n = len(token_ids)
        b = next(size for size in self.buckets if size >= n)
        i64 = torch.int64
        table = torch.zeros((n, self.max_pages), dtype=i64)  # columns past a context are never read
        for i, pages in enumerate(page_tables):
            table[i, : len(pages)] = torch.tensor(pages, dtype=i64)
        self.input_ids[:n].copy_(torch.tensor(token_ids, dtype=i64), non_blocking=True)
        self.positions[:, :n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(torch.tensor(slots, dtype=i64), non_blocking=True)
        self.context_lens[:n].copy_(torch.tensor(context_lens, dtype=i64), non_blocking=True)
        self.block_table[:n].copy_(table, non_blocking=True)
        # Rows n..b-1 are padding: restore their scratch state (an earlier, larger batch may have used them).
        self.input_ids[n:b].zero_()
        self.positions[:, n:b].zero_()
        self.slot_mapping[n:b].copy_(self.scratch_slots[n:b])
        self.context_lens[n:b].fill_(1)
        self.block_table[n:b].copy_((self.scratch_slots[n:b] // self.page_size)[:, None].expand(-1, self.max_pages))
        self._graphs[b].replay()
        self.replays += 1
        return self._outputs[b][:n].float()
