"""CUDA-graph steps: one captured forward of one-token rows per batch-size bucket.

Owns replaying the eager step computation without per-kernel launch overhead. A captured step is a set of
*rows* (`GraphRows`), each one new token with its own context: a decode row, or one token of a short
prefill without media (the question after a prefix hit), whose row sees its context up to itself. All rows'
K/V are written before any row attends, so a prefill's later tokens see the earlier ones written in the same
step, exactly as the packed prefill kernel does. Every input (token ids, M-RoPE positions, slot mapping,
context lengths, block table) lives in a static buffer refilled in place before replay, in two host-to-device
copies; the attention metadata's host facts are fixed per bucket (all query lengths 1, the longest possible
context, so the split-K shape never changes). Buckets of at least `cascade_min_batch` rows are captured twice,
the second time with cascade attention: each step the host finds the pages its rows share
(`plan_shared_prefix`); if some do, that graph replays and the rows' buffers say which keys the shared pass
reads for each row (a step that shares nothing keeps the plain graph: the shared pass and its merge would cost
~9 us per layer at batch 32 for nothing). A bucket larger than the step is padded with rows that write to
scratch KV slots no sequence owns and read only those; their logits are dropped. On a CPU pool nothing is
captured and the same rows run eagerly on the same buffers (how the CPU tests check the row construction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..kv.fp8 import KVPool
from ..model.qwen3_vl import Qwen3VLModel
from ..ops import cascade_attention
from ..ops.attention_metadata import PagedAttentionMetadata, SharedPrefix
from ..ops.paged_attention import PagedKVBackend
from .sampler import take_rows

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Rows of the packed per-row host inputs: token id, 3 M-RoPE positions, slot, context length, the keys of the
# row's context that cascade attention's shared pass reads, the cascade's leader row (the same in every column).
_ID, _POS, _SLOT, _CTX, _PREFIX, _LEADER = 0, slice(1, 4), 4, 5, 6, 7
_INPUT_ROWS = 8


def page_table(tables: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """[len(tables), width] int64: each sequence's physical pages in logical order, zero-padded."""
    table = np.zeros((len(tables), width), dtype=np.int64)
    for i, pages in enumerate(tables):
        table[i, : len(pages)] = pages
    return table


def destroy_graphs(graphs: dict, outputs: dict) -> None:
    """Destroy captured graphs now (`CUDAGraph.reset`), whoever still refers to them, and drop their outputs.
    A graph that captured an NCCL collective holds a reference on its communicator until it is destroyed, and
    NCCL's teardown of that communicator (destroy and abort alike) waits for it."""
    for graph in graphs.values():
        graph.reset()
    graphs.clear()
    outputs.clear()


@torch.inference_mode()
def capture_buckets(device: torch.device, buckets, forward, prepare=None, pool=None,
                    stream: torch.cuda.Stream | None = None) -> tuple[dict, dict]:
    """`forward(key)` of every key (a bucket, or anything sortable naming one) captured in a CUDA graph (largest
    first, sharing one memory pool: `pool`, else a new one), each after `prepare(key)` and two eager runs on a side
    stream, which compile the Triton kernels and settle the allocations outside the capture. `stream`: the capture
    stream (default: torch's one for every capture). cuBLAS keeps a workspace per stream and a graph replays the one
    of its capture stream, so graphs that may replay at the same time on two streams need two capture streams.
    ({key: graph}, {key: output}); nothing is captured off CUDA."""
    graphs, outputs = {}, {}
    if device.type != "cuda":
        return graphs, outputs
    memory = pool if pool is not None else torch.cuda.graph_pool_handle()
    try:
        for b in sorted(buckets, reverse=True):
            if prepare is not None:
                prepare(b)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward(b)
            torch.cuda.current_stream().wait_stream(side)
            graphs[b] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[b], pool=memory, stream=stream):
                outputs[b] = forward(b)
        torch.cuda.synchronize()
    except BaseException:  # the buckets captured so far go with the failure, not with its traceback
        destroy_graphs(graphs, outputs)
        raise
    return graphs, outputs


@dataclass(frozen=True)
class GraphRows:
    """A step as one-token rows. Row r is token `token_ids[r]` at slot `slots[r]`, attending over the first
    `context_lens[r]` positions of piece `row_piece[r]` (its own position included); `sample_rows` are the
    rows whose logits the step returns, in order."""

    token_ids: np.ndarray  # [n] int64
    positions: torch.Tensor  # [3, n] int64, host
    slots: np.ndarray  # [n] int64
    context_lens: np.ndarray  # [n] int64
    tables: list[Sequence[int]]  # each piece's physical pages in logical order
    row_piece: np.ndarray  # [n] int64
    sample_rows: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.token_ids)

    @property
    def max_context(self) -> int:
        return int(self.context_lens.max()) if self.num_rows else 0

    @classmethod
    def from_pieces(cls, pieces, page_size: int) -> GraphRows:
        """Rows of `pieces` (`step_payload.PieceInput` without padding): positions [start, end) of each."""
        if all(p.end - p.start == 1 and not p.pad for p in pieces):
            return cls._from_decodes(pieces, page_size)
        ids, slots, ctx, owner, sample, positions = [], [], [], [], [], []
        offset = 0
        for i, p in enumerate(pieces):
            if p.pad:
                raise ValueError("padded (deterministic) pieces do not run as graph rows")
            pos = np.arange(p.start, p.end, dtype=np.int64)
            ids.append(np.asarray(p.token_ids, dtype=np.int64))
            slots.append(p.slots(page_size))
            ctx.append(pos + 1)
            owner.append(np.full(len(pos), i, dtype=np.int64))
            positions.append(p.positions)
            offset += len(pos)
            if p.sample:
                sample.append(offset - 1)
        cat = np.concatenate
        return cls(cat(ids), torch.cat(positions, dim=1), cat(slots), cat(ctx), [p.pages for p in pieces],
                   cat(owner), sample)

    @classmethod
    def _from_decodes(cls, pieces, page_size: int) -> GraphRows:
        """`from_pieces` when every piece is one token (a decode step: one row per sequence, no per-piece arrays)."""
        n = len(pieces)
        starts = np.fromiter((p.start for p in pieces), np.int64, n)
        pages = np.fromiter((p.pages[p.start // page_size] for p in pieces), np.int64, n)
        return cls(np.fromiter((p.token_ids[0] for p in pieces), np.int64, n),
                   torch.cat([p.positions for p in pieces], dim=1), pages * page_size + starts % page_size,
                   starts + 1, [p.pages for p in pieces], np.arange(n, dtype=np.int64),
                   [i for i, p in enumerate(pieces) if p.sample])

    def block_table(self, width: int) -> np.ndarray:
        """[n, width] int64: each row's piece's pages (columns past a context are never read)."""
        return page_table(self.tables, width)[self.row_piece]


class RowGraphs:
    def __init__(
        self,
        model: Qwen3VLModel,
        pool: KVPool,
        first_scratch_page: int,
        max_batch: int,
        max_model_len: int,
        cascade_min_batch: int = 0,
        check_plans: bool = False,
    ) -> None:
        self.model = model
        self.check_plans = check_plans  # check every cascade plan on the host (`check_shared_prefix_plan`)
        self.pool = pool
        page_size = pool.layout.page_size
        self.page_size = page_size
        self.buckets = tuple(b for b in BUCKETS if b < max_batch) + (max_batch,)
        self.max_batch = max_batch
        self.cascade_min_batch = cascade_min_batch or max_batch + 1  # 0: no bucket
        self.max_pages = -(-max_model_len // page_size)
        self.max_context = self.max_pages * page_size
        dev = pool.device
        i64 = torch.int64
        # Padding row i of a bucket writes scratch slot i and reads one scratch slot (context length 1).
        self.scratch_slots = np.arange(max_batch, dtype=np.int64) + first_scratch_page * page_size
        # The host image of the buffers when every row is padding; a step overwrites its first rows.
        self._idle_rows = np.zeros((_INPUT_ROWS, max_batch), dtype=np.int64)
        self._idle_rows[_SLOT] = self.scratch_slots
        self._idle_rows[_CTX] = 1
        self._idle_table = np.repeat((self.scratch_slots // page_size)[:, None], self.max_pages, axis=1)
        # torch.tensor copies (from_numpy(...).to("cpu") would alias the templates on a CPU pool).
        self.row_inputs = torch.tensor(self._idle_rows, device=dev)
        self.input_ids = self.row_inputs[_ID]
        self.positions = self.row_inputs[_POS]
        self.slot_mapping = self.row_inputs[_SLOT]
        self.context_lens = self.row_inputs[_CTX]
        self.prefix_lens = self.row_inputs[_PREFIX]
        self.leader = self.row_inputs[_LEADER, :1]
        self.block_table = torch.tensor(self._idle_table, device=dev)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=i64, device=dev)
        self.logits_index = torch.arange(max_batch, dtype=i64, device=dev)
        self._staging = HostStaging(max_batch, self.max_pages, dev)
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.replays = 0
        self.shared_prefix_steps = 0  # steps whose rows shared pages (cascade attention read them once)

    def _forward(self, key: tuple[int, bool], context_lens_host: tuple[int, ...] | None = None) -> torch.Tensor:
        """The step over the first b rows of the buffers, key = (b, with cascade attention). Captured: the host
        facts say every row may reach the longest context (the kernels read the real lengths from
        `context_lens`); eager: the rows' own."""
        b, cascade = key
        shared = None
        if cascade:
            shared = SharedPrefix(self.prefix_lens[:b], self.leader, cascade_attention.SPLITS)
        meta = PagedAttentionMetadata(
            self.query_start_loc[: b + 1],
            self.context_lens[:b],
            self.block_table[:b],
            self.slot_mapping[:b],
            (1,) * b,
            context_lens_host or (self.max_context,) * b,
            self.page_size,
            self.pool.layout.num_pages - 1,
            shared,
        )
        backend = PagedKVBackend(self.pool, meta)
        return self.model(self.input_ids[:b], self.positions[:, :b], backend, logits_indices=self.logits_index[:b])

    def capture(self) -> None:
        """Capture every bucket, the cascade ones twice; nothing to capture on a CPU pool."""
        keys = [(b, False) for b in self.buckets] + [(b, True) for b in self.buckets if b >= self.cascade_min_batch]
        self._graphs, self._outputs = capture_buckets(self.pool.device, keys, self._forward)

    def fits(self, num_rows: int, max_context: int) -> bool:
        return 0 < num_rows <= self.max_batch and max_context <= self.max_context

    def release(self) -> None:
        """Destroy every captured bucket (`destroy_graphs`); a later step runs eagerly."""
        destroy_graphs(self._graphs, self._outputs)

    @torch.inference_mode()
    def run(self, rows: GraphRows, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One step over `rows`; logits [len(rows.sample_rows), vocab] in fp32. `token_ids` ([k], on the device)
        replaces the host token ids of the first k rows: async scheduling feeds the previous step's sampled tokens
        straight in, before the host has read them."""
        n = rows.num_rows
        if not self.fits(n, rows.max_context):
            raise ValueError(f"{n} rows up to context {rows.max_context} do not fit the captured graphs")
        if token_ids is not None and (token_ids.dim() != 1 or token_ids.numel() > n):
            raise ValueError(f"{tuple(token_ids.shape)} device token ids for {n} rows")
        b = next(size for size in self.buckets if size >= n)
        # Rows n..b-1 are padding: their scratch state is restored (an earlier, larger step may have used them).
        host, table = self._staging.take(b)
        host[:] = self._idle_rows[:, :b]
        host[_ID, :n] = rows.token_ids
        host[_POS, :n] = rows.positions.numpy()
        host[_SLOT, :n] = rows.slots
        host[_CTX, :n] = rows.context_lens
        table[:] = self._idle_table[:b]
        table[:n] = rows.block_table(self.max_pages)
        cascade = False
        if b >= self.cascade_min_batch:
            leader, prefix_lens = cascade_attention.plan_shared_prefix(table[:n], rows.context_lens, self.page_size)
            if self.check_plans:
                cascade_attention.check_shared_prefix_plan(table[:n], rows.context_lens, self.page_size, leader,
                                                           prefix_lens)
            host[_LEADER], host[_PREFIX, :n] = leader, prefix_lens
            cascade = bool(prefix_lens.any())
            self.shared_prefix_steps += cascade
        self._staging.copy_to(self.row_inputs[:, :b], self.block_table[:b])
        if token_ids is not None:
            self.input_ids[: token_ids.numel()].copy_(token_ids)
        key = (b, cascade)
        if key in self._graphs:
            self._graphs[key].replay()
            self.replays += 1
            logits = self._outputs[key]
        else:
            logits = self._forward(key, tuple(host[_CTX].tolist()))
        sample = rows.sample_rows
        if not sample:
            return logits[:0].float()
        if sample[-1] - sample[0] == len(sample) - 1:  # increasing rows without gaps: a slice, no index copy
            return logits[sample[0] : sample[-1] + 1].float()
        return take_rows(logits, sample).float()


class HostStaging:
    """Host images of the graphs' row inputs and block table, copied to the device without blocking the host.

    On CUDA two pinned buffers alternate: a pageable copy may wait for the work queued before it, which under
    async scheduling is the whole step still running; a buffer is written again only once the copy that read
    it (two steps ago) is done. Off CUDA one plain buffer (the copy is immediate)."""

    def __init__(self, max_batch: int, max_pages: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self._buffers = [(torch.empty(_INPUT_ROWS * max_batch, dtype=torch.int64, pin_memory=pinned),
                          torch.empty(max_batch * max_pages, dtype=torch.int64, pin_memory=pinned))
                         for _ in range(2 if pinned else 1)]
        self._done = [None] * len(self._buffers)  # CUDA events: the last copy out of each buffer finished
        self._max_pages = max_pages
        self._turn = 0
        self._current: tuple[torch.Tensor, torch.Tensor] | None = None

    def take(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """The next buffer as writable [_INPUT_ROWS, b] row inputs and [b, max_pages] table (NumPy views)."""
        self._turn = (self._turn + 1) % len(self._buffers)
        done = self._done[self._turn]
        if done is not None:
            done.synchronize()
        rows, table = self._buffers[self._turn]
        self._current = (rows[: _INPUT_ROWS * b].view(_INPUT_ROWS, b), table[: b * self._max_pages].view(b, self._max_pages))
        return self._current[0].numpy(), self._current[1].numpy()

    def copy_to(self, row_inputs: torch.Tensor, block_table: torch.Tensor) -> None:
        """Copy the buffer `take` returned into the device buffers."""
        assert self._current is not None
        rows, table = self._current
        row_inputs.copy_(rows, non_blocking=True)
        block_table.copy_(table, non_blocking=True)
        if row_inputs.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(row_inputs.device))
            self._done[self._turn] = event
        self._current = None
