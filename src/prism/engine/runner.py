"""Executing one scheduled step on the device: transfers, vision, decoder, logits.

Owns the device state (model, KV pools, encoder cache) and the *hit == miss* property on its side
(invariant 11): every step's attention reads K/V back through the paged (possibly FP8) cache, also for
the tokens written in that step, so a prefix that was computed earlier (a hit) and one computed now (a
miss) are read identically. Vision runs only for media items whose tokens are computed this step and
whose features are not in the encoder cache; a full prefix hit runs no vision at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.fp8 import KVLayout, KVPool
from ..kv.manager import KVCacheManager
from ..kv.transfers import execute_plan
from ..media.cache import CacheKey, PreprocessCache
from ..model.qwen3_vl import MultimodalEmbeddings, Qwen3VLModel
from ..ops.paged_attention import PagedAttentionMetadata, PagedKVBackend
from .cuda_graphs import DecodeGraphs
from .scheduler import ScheduledSlice


@dataclass(frozen=True)
class _Piece:
    """Positions [start, end) of one request in a forward, then `pad` filler rows (deterministic tiles)."""

    request: object
    start: int
    end: int
    pad: int
    sample: bool


@dataclass
class RunnerStats:
    steps: int = 0
    tokens_computed: int = 0
    vision_items_encoded: int = 0  # media items that went through the vision encoder
    encoder_cache_hits: int = 0  # media items whose features came from the encoder cache


def token_positions(request, start: int, end: int) -> torch.Tensor:
    """M-RoPE positions [3, end - start] of tokens [start, end): the prompt's own, then text positions
    continued with the rope delta for generated tokens."""
    prompt = request.prompt
    n_prompt = len(prompt.token_ids)
    out = torch.empty(3, end - start, dtype=torch.int64)
    split = min(max(start, n_prompt), end)
    if split > start:
        out[:, : split - start] = torch.as_tensor(prompt.positions)[:, start:split]
    if end > split:
        out[:, split - start :] = torch.arange(split, end, dtype=torch.int64) + prompt.rope_delta
    return out


class ModelRunner:
    def __init__(
        self,
        model: Qwen3VLModel,
        layout: KVLayout,
        num_cpu_pages: int,
        encoder_cache_bytes: int,
        *,
        cuda_graph_max_batch: int | None = None,
        max_model_len: int = 0,
        deterministic: bool = False,
    ) -> None:
        self.model = model
        self.device = model.device
        self.deterministic = deterministic
        use_graphs = cuda_graph_max_batch is not None and self.device.type == "cuda" and not deterministic
        # CUDA graphs pad batches with rows that write scratch pages past the manager's pages.
        scratch = -(-cuda_graph_max_batch // layout.page_size) if use_graphs else 0
        self.gpu_pool = KVPool.allocate(layout.with_num_pages(layout.num_pages + scratch), self.device)
        self.cpu_pool = (
            KVPool.allocate(layout.with_num_pages(num_cpu_pages), "cpu", pin_memory=self.device.type == "cuda")
            if num_cpu_pages
            else None
        )
        self.encoder_cache: PreprocessCache = PreprocessCache(encoder_cache_bytes)
        self.stats = RunnerStats()
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            self.graphs = DecodeGraphs(model, self.gpu_pool, layout.num_pages, cuda_graph_max_batch, max_model_len)
            self.graphs.capture()

    @torch.inference_mode()
    def execute(self, slices: list[ScheduledSlice], kv: KVCacheManager) -> torch.Tensor:
        """Run the pending transfer plan and the model over `slices`; fp32 logits of the sampling slices."""
        plan = kv.take_plan()
        try:
            execute_plan(plan, self.gpu_pool, self.cpu_pool)
            if not slices:
                return torch.empty(0)
            if self.deterministic:
                return self._execute_deterministic(slices, kv)
            if self.graphs is not None and self._is_graph_decode(slices):
                return self._graph_decode(slices, kv)
            return self._forward([_Piece(s.request, s.start, s.end, 0, s.sample) for s in slices], kv)
        finally:
            kv.finish_plan(plan)

    def _forward(self, pieces: list[_Piece], kv: KVCacheManager) -> torch.Tensor:
        """One packed forward over the pieces; fp32 logits of the sampling pieces' last real rows."""
        ids, positions, rows = [], [], []
        offset = 0
        for p in pieces:
            ids.extend(p.request.all_token_ids[p.start : p.end])
            ids.extend([0] * p.pad)
            positions.append(token_positions(p.request, p.start, p.end + p.pad))
            if p.sample:
                rows.append(offset + p.end - p.start - 1)
            offset += p.end + p.pad - p.start
        meta = PagedAttentionMetadata.build(
            [p.end + p.pad - p.start for p in pieces],
            [p.end + p.pad for p in pieces],
            [[page for _, page in kv.seqs[p.request.request_id].pages] for p in pieces],
            kv.page_size,
            self.device,
        )
        logits = self.model(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.cat(positions, dim=1).to(self.device),
            PagedKVBackend(self.gpu_pool, meta, prefill_kernel=not self.deterministic),
            multimodal=self._media_features(pieces),
            logits_indices=torch.tensor(rows, dtype=torch.int64, device=self.device),
        )
        self.stats.steps += 1
        self.stats.tokens_computed += offset
        return logits.float()

    # -- deterministic mode ----------------------------------------------------------------------
    def _execute_deterministic(self, slices: list[ScheduledSlice], kv: KVCacheManager) -> torch.Tensor:
        """Every sequence alone, in page-aligned tiles of exactly one page of rows (padded), recomputing
        the frontier page from its start: every token is always computed in the same tile at the same row
        with the same shapes, whatever the batch, the chunking or the cache did."""
        size = kv.page_size
        out = []
        for s in slices:
            tile_start = (s.start // size) * size
            while tile_start < s.end:
                tile_end = min(tile_start + size, s.end)
                last = tile_end == s.end
                piece = _Piece(s.request, tile_start, tile_end, tile_start + size - tile_end, s.sample and last)
                logits = self._forward([piece], kv)
                if piece.sample:
                    out.append(logits)
                tile_start += size
        return torch.cat(out) if out else torch.empty(0)

    # -- CUDA-graph decode ------------------------------------------------------------------------
    def _is_graph_decode(self, slices: list[ScheduledSlice]) -> bool:
        assert self.graphs is not None
        if any(s.end - s.start != 1 or not s.sample for s in slices):
            return False
        return self.graphs.fits(len(slices), max(s.end for s in slices))

    def _graph_decode(self, slices: list[ScheduledSlice], kv: KVCacheManager) -> torch.Tensor:
        assert self.graphs is not None
        size = kv.page_size
        tables = [[page for _, page in kv.seqs[s.request.request_id].pages] for s in slices]
        logits = self.graphs.run(
            [s.request.all_token_ids[s.start] for s in slices],
            torch.cat([token_positions(s.request, s.start, s.end) for s in slices], dim=1),
            [table[s.start // size] * size + s.start % size for s, table in zip(slices, tables, strict=True)],
            [s.end for s in slices],
            tables,
        )
        self.stats.steps += 1
        self.stats.tokens_computed += len(slices)
        return logits

    # -- vision ----------------------------------------------------------------------------------
    def _media_features(self, pieces: list[_Piece]) -> MultimodalEmbeddings | None:
        """Features of every media token computed this step, placed at their rows of the packed batch."""
        wanted = []  # (packed row of the first token, media item, offset in the item's features, length)
        row = 0
        for p in pieces:
            for item in p.request.prompt.media:
                item_offset = 0
                for span_start, span_len in item.spans:
                    lo, hi = max(p.start, span_start), min(p.end, span_start + span_len)
                    if lo < hi:
                        wanted.append((row + lo - p.start, item, item_offset + lo - span_start, hi - lo))
                    item_offset += span_len
            row += p.end + p.pad - p.start
        if not wanted:
            return None
        features = self._encode({id(item): item for _, item, _, _ in wanted}.values())
        token_index, embeds, deepstack = [], [], []
        for first_row, item, item_offset, length in wanted:
            item_embeds, item_deepstack = features[item.digest]
            token_index.append(torch.arange(first_row, first_row + length, dtype=torch.int64))
            embeds.append(item_embeds[item_offset : item_offset + length])
            deepstack.append(item_deepstack[:, item_offset : item_offset + length])
        return MultimodalEmbeddings(
            token_index=torch.cat(token_index).to(self.device),
            embeds=torch.cat(embeds),
            deepstack=torch.cat(deepstack, dim=1),
        )

    def _encode(self, items) -> dict[bytes, tuple[torch.Tensor, torch.Tensor]]:
        """Vision features of each item, from the encoder cache or one batched encoder run."""
        features: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        missing = []
        for item in items:
            cached = self.encoder_cache.get(CacheKey(item.digest, "vision"))
            if cached is not None:
                features[item.digest] = cached
                self.stats.encoder_cache_hits += 1
            elif item.digest not in {m.digest for m in missing}:
                missing.append(item)
        # Deterministic mode encodes one item at a time: an item's features never depend on its companions.
        groups = [[m] for m in missing] if self.deterministic else ([missing] if missing else [])
        for group in groups:
            pixels = torch.cat([m.pixel_values for m in group]).to(self.device, self.model.dtype)
            out = self.model.encode_media(pixels, [list(m.grid_thw) for m in group])
            start = 0
            for item, count in zip(group, out.tokens_per_item, strict=True):
                value = (out.embeds[start : start + count], out.deepstack[:, start : start + count])
                start += count
                features[item.digest] = value
                nbytes = value[0].numel() * value[0].element_size() + value[1].numel() * value[1].element_size()
                self.encoder_cache.put(CacheKey(item.digest, "vision"), value, nbytes)
            self.stats.vision_items_encoded += len(group)
        return features
