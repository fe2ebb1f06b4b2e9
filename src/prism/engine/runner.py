"""Executing one scheduled step on the device: transfers, vision, decoder, logits.

Owns the device state (model, KV pools, encoder cache) and the *hit == miss* property on its side
(invariant 11): every step's attention reads K/V back through the paged (possibly FP8) cache, also for
the tokens written in that step, so a prefix that was computed earlier (a hit) and one computed now (a
miss) are read identically. Vision runs only for media items whose tokens are computed this step and
whose features are not in the encoder cache (or that the scheduler sends ahead of their prefill); a full
prefix hit runs no vision at all. Decodes and short prefills without media replay a CUDA graph as one-token
rows (`cuda_graphs.py`), steps with a prefill the packed graphs (`packed_graphs.py`) where they fit; other steps
run one packed eager forward. Deterministic mode runs one tile per forward, each through a packed bucket of a page.
Every step goes through a `StepPayload` (built on rank 0 by `step_building`, run on every rank), with one rank or several.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from ..distributed.capacity import allocate_kv_pools
from ..distributed.encoder_dp import encode_media_items
from ..distributed.tensor_parallel import TPGroup
from ..kv.fp8 import KVLayout
from ..kv.manager import KVCacheManager
from ..kv.transfers import TransferPlan, execute_plan
from ..media.cache import CacheKey, PreprocessCache
from ..model.qwen3_vl import MultimodalEmbeddings, Qwen3VLModel
from ..ops import pdl
from ..ops.attention_metadata import PagedAttentionMetadata
from ..ops.dispatch import kernels_override
from ..ops.host_copy import to_device
from ..ops.paged_attention import PagedKVBackend
from ..ops.paged_prefill import compile_attention_variants
from .background_encoding import BackgroundEncoding, stream_apart
from .cuda_graphs import GraphRows, RowGraphs
from .packed_graphs import PackedGraphs, PackedStep
from .scheduler import ScheduledSlice
from .step_building import build_payload, token_positions
from .step_payload import ForwardInput, MediaSlice, MediaWork, PieceInput, StepPayload, media_work
from .vision_graphs import VisionGraphs, capture_encoder
from .warm_up import warm_up_first_uses

# Prefill tokens x their context lengths that a graph step may take as rows: a 64-row decode at 2K contexts.
MAX_GRAPH_PREFILL_KEY_READS = 64 * 2048


@dataclass
class RunnerStats:
    steps: int = 0
    graph_steps: int = 0  # steps run as the CUDA graphs' one-token rows (replayed on CUDA, eager off it)
    packed_graph_steps: int = 0  # steps run through the packed graphs' static buffers (replayed on CUDA)
    tokens_computed: int = 0
    vision_items_encoded: int = 0  # media items that went through the vision encoder
    encoder_cache_hits: int = 0  # media items whose features came from the encoder cache


class ModelRunner:
    """One rank's device state. Rank 0 turns (slices, KV page tables) into a `StepPayload`, hands it to
    `publish` (the TP step channel; nothing with one rank) and runs it; follower ranks run the payloads
    they receive. `group` is the TP group the model was sharded over (the KV pool holds this rank's KV
    heads, `layout`)."""

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
        group: TPGroup | None = None,
        graph_rows_without_cuda: bool = False,
        packed_graph_max_tokens: int | None = None,
        max_num_seqs: int = 64,
        cascade_min_batch: int = 0,
        vision_graphs: int = 0,
        programmatic_launch: bool = False,
        background_encoding: bool = False,
        check_invariants: bool = False,
        kv_setting: tuple[str, int] | None = None,
    ) -> None:
        self.model = model
        self.device = model.device
        self.layout = layout
        self.page_size = layout.page_size
        self.deterministic = deterministic
        self.group = group or TPGroup.single(self.device)
        self.publish: Callable[[StepPayload], None] | None = None
        # graph_rows_without_cuda: off CUDA, run the steps the graphs would replay as the same rows, eagerly
        # (how the CPU tests put that path through the whole engine).
        # The graphs are captured with placeholder host lengths that only the Triton kernels ignore (they read the
        # real ones on the device): with the torch reference attention forced on CUDA, nothing is captured.
        use_graphs = (cuda_graph_max_batch is not None and not deterministic
                      and (self.device.type == "cuda" and kernels_override() != "reference"
                           or graph_rows_without_cuda))
        use_packed = use_graphs and bool(packed_graph_max_tokens)
        # Deterministic mode runs every forward (one tile: one sequence, one page of rows) through one packed bucket
        # of a page: replayed on CUDA (an eager tile was ~25 ms of launches on the H200's host for ~7 ms of GPU
        # work), on its static buffers elsewhere, so a tile's arithmetic is the same on every device path.
        capture_tiles = (deterministic and cuda_graph_max_batch is not None and self.device.type == "cuda"
                         and kernels_override() != "reference")
        # CUDA graphs pad batches with rows that write scratch pages past the manager's pages.
        scratch_rows = (max(cuda_graph_max_batch or 0, packed_graph_max_tokens or 0) if use_graphs
                        else layout.page_size if deterministic else 0)
        scratch = -(-scratch_rows // layout.page_size)
        # Allocated only if they fit on every rank, else every rank raises the same KVCapacityError naming
        # `kv_setting` (the config key that sized the pool, and its value) or num_cpu_pages.
        key, value = kv_setting or ("num_gpu_pages", layout.num_pages)
        self.gpu_pool, self.cpu_pool = allocate_kv_pools(self.group, layout, self.device, num_cpu_pages, key=key,
                                                         value=value, scratch_pages=scratch)
        self.encoder_cache: PreprocessCache = PreprocessCache(encoder_cache_bytes)
        self.background: BackgroundEncoding | None = None
        self._encode_ahead_failure: Exception | None = None
        self.stats = RunnerStats()
        self.graphs: RowGraphs | None = None
        self.vision_graphs: VisionGraphs | None = None
        self.packed: PackedGraphs | None = None
        # Every forward of this runner, captured or eager, launches the decode kernels early or not, as configured:
        # one compiled variant of each for the start to compile.
        self.programmatic_launch = programmatic_launch
        try:
            with pdl.programmatic_launch(programmatic_launch):
                if self.device.type == "cuda" and not deterministic and kernels_override() != "reference":
                    text = model.config.text
                    compile_attention_variants(self.gpu_pool, self.group_q_heads(text), model.dtype)
                    warm_up_first_uses(model, self.gpu_pool)
                if use_graphs:
                    self.graphs = RowGraphs(model, self.gpu_pool, layout.num_pages, cuda_graph_max_batch,
                                            max_model_len, cascade_min_batch=cascade_min_batch,
                                            check_plans=check_invariants)
                    self.graphs.capture()
                if use_packed:
                    self.packed = PackedGraphs(model, self.gpu_pool, layout.num_pages, packed_graph_max_tokens,
                                               max_num_seqs, max_model_len)
                    self.packed.capture()
                if deterministic:
                    self.packed = PackedGraphs(model, self.gpu_pool, layout.num_pages, layout.page_size, 1,
                                               max_model_len, buckets=(layout.page_size,))
                    if capture_tiles:
                        self.packed.capture()
            background_encoding = background_encoding and self.device.type == "cuda" and self.group.world_size == 1
            vision_capture = None
            if background_encoding:
                # The decoder's graphs were captured on torch's capture stream; the vision graphs get their own, and
                # the encodings beside the decodes a third stream (one cuBLAS workspace each: background_encoding.py).
                if torch.cuda.graph.default_capture_stream is None:  # made now, as torch would make it later
                    torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
                taken = [torch.cuda.graph.default_capture_stream]
                vision_capture = stream_apart(self.device, taken)
                self.background = BackgroundEncoding(self.device, [*taken, vision_capture])
            if vision_graphs and self.device.type == "cuda":
                self.vision_graphs = VisionGraphs(
                    model.encode_media,
                    functools.partial(capture_encoder, model.visual, pool=torch.cuda.graph_pool_handle(),
                                      stream=vision_capture, plan_free=deterministic),
                    max_graphs=vision_graphs)
        except BaseException:  # graphs captured before the failure would pin a TP group's communicators
            self.release_cuda_graphs()
            raise

    def release_cuda_graphs(self) -> None:
        """Destroy every captured graph (decode rows, packed prefill, vision encoder); steps run eagerly after.
        A tensor-parallel rank does this before it leaves its group: its graphs captured NCCL collectives, which
        pin the communicators (`tp_workers.leave_group`)."""
        if self.background is not None:
            self.background.wait()
        for holder in (self.graphs, self.packed, self.vision_graphs):
            if holder is not None:
                holder.release()
        self.graphs = self.vision_graphs = None
        if not self.deterministic:  # deterministic tiles go on through the holder's buffers, eagerly
            self.packed = None

    def group_q_heads(self, text) -> int:
        """Query heads on this rank (the KV pool holds this rank's share of the KV heads)."""
        return text.num_attention_heads * self.layout.num_kv_heads // text.num_key_value_heads

    @torch.inference_mode()
    def execute(self, slices: list[ScheduledSlice], kv: KVCacheManager, plan: TransferPlan,
                media_ahead: Sequence = (), pending: Collection[str] = (),
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run the step's transfer plan (taken from `kv` by the engine, which finishes it, and runs what of it did not
        run if the step fails: `lost_steps`) and the model over `slices`; fp32 logits of the sampling slices.
        `media_ahead`: media items to encode into the encoder cache this step for a prefill of the next one.
        `pending` (async scheduling): the requests whose slice is one decode row fed `token_ids[i]` (on rank 0's
        device, sampled by the step still running) instead of a token the host has read; those rows come first, in
        order, and sample. Under TP the followers take those tokens from rank 0 (`run`)."""
        return self._execute(slices, kv, plan, media_ahead, pending, token_ids)

    def _execute(self, slices: list[ScheduledSlice], kv: KVCacheManager, plan: TransferPlan,
                 media_ahead: Sequence, pending: Collection[str], token_ids: torch.Tensor | None) -> torch.Tensor:
        """`execute`, also for `execute_decode_rows`' steps with a chunk (not through the attribute: what wraps
        `execute` sees the scheduler's steps only)."""
        if pending:
            if self.deterministic:
                raise RuntimeError("rows fed device tokens need the default mode")
            lead = slices[: len(pending)]
            if (token_ids is None or token_ids.numel() != len(pending) or any(s.end - s.start != 1 for s in lead)
                    or {s.request.request_id for s in lead} != set(pending)):
                raise ValueError("rows fed device tokens must be the step's first, one token and one id each")
        payload = self.prepare(plan, slices, kv, media_ahead, pending)
        if self.publish is not None:
            self.publish(payload)
        return self.run(payload, token_ids if pending else None)

    def run_plan_of_a_lost_step(self, plan: TransferPlan) -> None:
        """The moves of a step lost or interrupted before it ran them all, from the first stage it did not finish
        (`lost_steps.settle_the_plan` asks, on one rank only: under TP a lost step's plan is only unpinned)."""
        execute_plan(plan, self.gpu_pool, self.cpu_pool)

    # -- rank 0: building the payload ------------------------------------------------------------
    def prepare(self, plan: TransferPlan, slices: list[ScheduledSlice], kv: KVCacheManager,
                media_ahead: Sequence = (), pending: Collection[str] = ()) -> StepPayload:
        """The step as data (`step_building.build_payload`), each forward marked with the graphs that run it."""
        return build_payload(plan, slices, kv, page_size=self.page_size, deterministic=self.deterministic,
                             graph_for=self._graph_for, is_encoder_cached=self.is_encoder_cached,
                             media_ahead=media_ahead, pending=pending)

    @torch.inference_mode()
    def encode_ahead(self, items: list[MediaWork]) -> None:
        """Encode media items into the encoder cache now, between steps (one rank: the followers run steps only)."""
        if self.publish is not None:
            raise RuntimeError("encoding outside a step needs a single rank")
        self._order_after_background()
        self._encode(items)

    def is_encoder_cached(self, digest: bytes) -> bool:
        return CacheKey(digest, "vision") in self.encoder_cache

    def encodes_beside_decodes(self) -> bool:
        """Whether media encoded ahead run on the side stream, beside the decodes (`BackgroundEncoding`)."""
        return self.background is not None

    @torch.inference_mode()
    def encode_beside_decodes(self, items: Sequence) -> None:
        """Launch the encoding of `items` (a waiting request's media, the scheduler's `media_ahead`) now, on the side
        stream where there is one, before the step that decodes beside it is launched; a failure is kept for
        `take_encode_ahead_failure`, as in `_encode_ahead_in_step`."""
        work = [m for m in media_work(items, self.is_encoder_cached) if m.encode]
        self._encode_ahead_failure = None
        if work:
            self._encode_ahead_in_step(work, beside_decodes=True)

    def encoding_in_background(self) -> bool:
        """Whether media encoded ahead beside the decodes may still be encoding (a query: never waits)."""
        return self.background is not None and self.background.pending()

    def encoding_finished_before(self, event: torch.cuda.Event | None, pause_s: float = 0.0) -> bool:
        """Wait on the host until the encoding beside the decodes completes, or `event` (on the main stream) does and
        `pause_s` pass, whichever is first; whether the encoding has (`BackgroundEncoding.finished_before`)."""
        return self.background is None or self.background.finished_before(event, pause_s)

    def _order_after_background(self) -> None:
        if self.background is not None:
            self.background.order_main_after()

    def _graph_for(self, pieces: list[PieceInput], media: list[MediaSlice]) -> str:
        """Which captured graphs run this forward ("rows", "packed" or "" for an eager forward). Decodes replay
        the one-token rows. A step with a prefill replays the packed graphs (the prefill kernel shares each key
        tile among a block of tokens: W2's 30-token question after a hit took 7.9 ms packed, 8.6 ms as rows, on
        the H200); without them, a short prefill without media goes to the rows, where each prefill token reads
        its whole context on its own, so only while that re-reading stays small."""
        if self.deterministic:  # one tile (`step_building.deterministic_tiles`): its bucket, replayed where captured
            return "packed"
        tokens, longest = sum(p.end - p.start for p in pieces), max(p.end for p in pieces)
        decode_only = all(p.end - p.start == 1 for p in pieces)
        if decode_only and not media and self.graphs is not None and self.graphs.fits(tokens, longest):
            return "rows"
        if self.packed is not None and self.packed.fits(tokens, len(pieces), longest):
            return "packed"
        prefill_key_reads = sum((p.end - p.start) * p.end for p in pieces if p.end - p.start > 1)
        if (self.graphs is not None and not media and prefill_key_reads <= MAX_GRAPH_PREFILL_KEY_READS
                and self.graphs.fits(tokens, longest)):
            return "rows"
        return ""

    # -- every rank: running the payload ---------------------------------------------------------
    @torch.inference_mode()
    def run(self, payload: StepPayload, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Transfers, vision, decoder: the same on every rank. fp32 logits of the sampled rows. `token_ids`: the
        input ids of the first `payload.device_token_rows` rows, on the device (async scheduling; one forward):
        rank 0's, which every rank takes by a broadcast under TP (a follower passes none)."""
        if payload.device_token_rows and self.group.world_size > 1:
            token_ids = self._device_tokens_from_first(payload.device_token_rows, token_ids)
        with pdl.programmatic_launch(self.programmatic_launch):
            return self._run(payload, token_ids)

    def _device_tokens_from_first(self, count: int, token_ids: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's device token ids of a step's first `count` rows, on every rank (one collective, in step order on
        every rank as the steps are)."""
        if self.group.rank == 0:
            if token_ids is None or token_ids.numel() != count:
                raise ValueError(f"rank 0 must pass the {count} device token ids of the step's first rows")
            shared = token_ids.to(device=self.group.device, dtype=torch.int64).contiguous()
        else:
            shared = torch.empty(count, dtype=torch.int64, device=self.group.device)
        return self.group.broadcast_from_first(shared).to(self.device)

    def _run(self, payload: StepPayload, token_ids: torch.Tensor | None) -> torch.Tensor:
        self._encode_ahead_failure = None
        execute_plan(payload.plan, self.gpu_pool, self.cpu_pool)  # counts its stages: a lost step runs on from there
        if not payload.forwards:
            return torch.empty(0)
        ahead = self._media_read_by_no_forward(payload)
        ahead_digests = {m.digest for m in ahead}
        media = [m for m in payload.media if m.digest not in ahead_digests]
        features = {}
        if media:
            self._order_after_background()
            features = self._encode(media, may_capture=not payload.beside_decodes)
        # Beside the decodes, the encoding ahead is queued after the forwards (their kernels reach the SMs first: W4's
        # longest gap 21.8 -> 18 ms on the H200, session 15); its stream does not wait for them.
        if ahead and self.background is None:
            self._encode_ahead_in_step(ahead, payload.beside_decodes)
        out = []
        for forward in payload.forwards:
            if forward.graph == "rows":
                logits = self._graph_step(forward, token_ids)
            elif forward.graph == "packed":
                logits = self._packed_step(forward, features, token_ids)
            else:
                logits = self._forward(forward, features, token_ids)
            if len(payload.forwards) == 1 or any(p.sample for p in forward.pieces):
                out.append(logits)
        if ahead and self.background is not None:
            self._encode_ahead_in_step(ahead, payload.beside_decodes)
        if len(payload.forwards) == 1:
            return out[0]
        return torch.cat(out) if out else torch.empty(0)

    def _encode_ahead_in_step(self, work: list[MediaWork], beside_decodes: bool) -> None:
        """Encode items for a later step's prefill (a step that has them reads no media: the scheduler sends them
        ahead only when no prefill runs), on the side stream beside the decodes when there is one. With one rank a
        failure is the waiting request's alone: it is kept for the engine (`take_encode_ahead_failure`) and this
        step's requests go on. With several it fails the step (the ranks' encoder caches must stay the same)."""
        try:
            if self.background is not None:
                self.background.run(lambda: self._encode(work, may_capture=False, capture_overdue=False))
            else:
                self._encode(work, may_capture=not beside_decodes)
        except Exception as error:
            if self.group.world_size > 1:
                raise
            self._encode_ahead_failure = error

    def take_encode_ahead_failure(self) -> Exception | None:
        """The error of the last step's encoding ahead, if it failed (then cleared)."""
        failure, self._encode_ahead_failure = self._encode_ahead_failure, None
        return failure

    @staticmethod
    def _media_read_by_no_forward(payload: StepPayload) -> list[MediaWork]:
        """The items this step encodes for a later one (encoded ahead): no forward of the step reads them."""
        read = {m.digest for forward in payload.forwards for m in forward.media}
        return [m for m in payload.media if m.encode and m.digest not in read]

    def _forward(self, forward: ForwardInput, features: dict[bytes, tuple[torch.Tensor, torch.Tensor]],
                 token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One packed forward over the pieces; fp32 logits of the sampling pieces' last real rows. `token_ids`:
        the ids of the first rows, on the device (async scheduling)."""
        ids, rows = [], []
        offset = 0
        for p in forward.pieces:
            ids.extend(p.token_ids)
            ids.extend([0] * p.pad)
            if p.sample:
                rows.append(offset + p.end - p.start - 1)
            offset += p.num_rows
        pieces = forward.pieces
        meta = PagedAttentionMetadata.build(
            [p.num_rows for p in pieces], [p.end + p.pad for p in pieces], [p.pages for p in pieces],
            self.page_size, self.device,
        )
        input_ids = to_device(ids, self.device, torch.int64)
        if token_ids is not None:
            input_ids[: token_ids.numel()].copy_(token_ids)
        logits = self.model(
            input_ids,
            to_device(torch.cat([p.positions for p in pieces], dim=1), self.device),
            PagedKVBackend(self.gpu_pool, meta),
            multimodal=self._place_media(forward.media, features),
            logits_indices=to_device(rows, self.device, torch.int64),
        )
        self.stats.steps += 1
        self.stats.tokens_computed += offset
        return logits.float()

    def replays_decode_rows(self, num_rows: int, max_context: int) -> bool:
        """Whether `execute_decode_rows` takes a decode step of `num_rows` sequences up to `max_context`."""
        return self.graphs is not None and self.graphs.fits(num_rows, max_context)

    def replays_chunk_beside_rows(self, num_rows: int, chunk_tokens: int, max_context: int) -> bool:
        """Whether `execute_decode_rows` takes `num_rows` decode rows and a chunk of `chunk_tokens` (the packed
        graphs; never deterministic mode's page bucket, which takes one tile of one sequence)."""
        return (not self.deterministic and self.packed is not None
                and self.packed.fits(num_rows + chunk_tokens, num_rows + 1, max_context))

    @torch.inference_mode()
    def execute_decode_rows(self, slices: list[ScheduledSlice], kv: KVCacheManager, plan: TransferPlan,
                            token_ids: torch.Tensor, chunk: ScheduledSlice | None = None) -> torch.Tensor:
        """Async scheduling: a decode step whose input tokens the host has not seen. Slice i computes position
        `start` of its sequence with input `token_ids[i]` (on the device: sampled by the step still running),
        replayed as graph rows; with `chunk` (a prefill chunk, its tokens known), the rows and the chunk after
        them replay the packed graphs. Under TP the step goes to the followers as a payload, and every rank takes
        the tokens from rank 0 (`run`). fp32 logits, one row per slice, then the chunk's if it samples. The KV
        manager holds a pending token at each row's position, and the step's plan (taken by the engine) no transfer."""
        if (self.graphs if chunk is None else self.packed) is None:
            raise RuntimeError("a step with device tokens needs the CUDA graphs")
        if not plan.is_empty():
            raise RuntimeError("a step with device tokens cannot run a transfer plan")
        if any(s.end - s.start != 1 for s in slices):
            raise ValueError("only one-token decode rows take device tokens")
        if chunk is not None:  # a mixed step, built as the scheduler's are
            context = max(s.end for s in [*slices, chunk])
            if not self.replays_chunk_beside_rows(len(slices), chunk.end - chunk.start, context):
                raise ValueError("decode rows and a chunk with device tokens must fit the captured packed graphs")
            return self._execute([*slices, chunk], kv, plan, (), [s.request.request_id for s in slices], token_ids)
        if self.publish is not None:  # the followers need the step as a payload
            return self._execute(slices, kv, plan, (), [s.request.request_id for s in slices], token_ids)
        # The hot path (every decode step of one rank): its rows built here, without a payload.
        pieces = [
            PieceInput([0], token_positions(s.request, s.start, s.end), s.start, s.end, 0,
                       [page for _, page in kv.seqs[s.request.request_id].pages], True)
            for s in slices
        ]
        if self._graph_for(pieces, []) != "rows":
            raise ValueError("decode rows with device tokens must fit the captured row graphs")
        return self._graph_step(ForwardInput(pieces, [], graph="rows"), token_ids)

    def _graph_step(self, forward: ForwardInput, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        assert self.graphs is not None
        rows = GraphRows.from_pieces(forward.pieces, self.page_size)
        logits = self.graphs.run(rows, token_ids)
        self.stats.steps += 1
        self.stats.graph_steps += 1
        self.stats.tokens_computed += rows.num_rows
        return logits

    def _packed_step(self, forward: ForwardInput, features, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        assert self.packed is not None
        step = PackedStep.from_pieces(forward.pieces, forward.media, self.page_size)
        logits = self.packed.run(step, self._place_media(forward.media, features), token_ids)
        self.stats.steps += 1
        self.stats.packed_graph_steps += 1
        self.stats.tokens_computed += step.num_tokens
        return logits

    # -- vision ----------------------------------------------------------------------------------
    def _place_media(self, media: list[MediaSlice], features) -> MultimodalEmbeddings | None:
        """Features of every media token computed in this forward, placed at their rows of the packed batch."""
        if not media:
            return None
        token_index, embeds, deepstack = [], [], []
        for m in media:
            item_embeds, item_deepstack = features[m.digest]
            token_index.append(torch.arange(m.row, m.row + m.length, dtype=torch.int64))
            embeds.append(item_embeds[m.offset : m.offset + m.length])
            deepstack.append(item_deepstack[:, m.offset : m.offset + m.length])
        return MultimodalEmbeddings(
            token_index=to_device(torch.cat(token_index), self.device),
            embeds=torch.cat(embeds),
            deepstack=torch.cat(deepstack, dim=1),
        )

    def _encode(self, work: list[MediaWork], may_capture: bool = True,
                capture_overdue: bool = True) -> dict[bytes, tuple[torch.Tensor, torch.Tensor]]:
        """Vision features of each item: from the encoder cache (kept identical on every rank: the same
        gets and puts in the same order), or encoded data-parallel over the ranks in one pass. `may_capture`:
        whether a grid list due for a vision graph may be captured in this step (not beside decodes);
        `capture_overdue`: whether one overdue may be (`VisionGraphs.encode`; never on the side stream)."""
        features: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        missing = []
        for m in work:
            if not m.encode:
                cached = self.encoder_cache.get(CacheKey(m.digest, "vision"))
                if cached is None:
                    raise RuntimeError("a media item expected in the encoder cache is not there (ranks diverged?)")
                features[m.digest] = cached
                self.stats.encoder_cache_hits += 1
            else:
                missing.append(m)
        if not missing:
            return features
        # Deterministic mode encodes one item at a time: an item's features never depend on its companions.
        try:
            encoded = encode_media_items(
                self.model, [m.grid for m in missing], [m.pixels for m in missing], self.group,
                one_at_a_time=self.deterministic,
                encode=(functools.partial(self.vision_graphs.encode, may_capture=may_capture,
                                          capture_overdue=capture_overdue)
                        if self.vision_graphs is not None else None),
            )
        finally:  # even a failed encoding may have queued work on the vision pool
            if self.background is not None and torch.cuda.current_stream(self.device) != self.background.stream:
                self.background.after_main_vision()  # the side stream's next encoding waits for this one
        for m, value in zip(missing, encoded, strict=True):
            # The cache keeps what it counts: an item's features as views would keep its whole encoding batch alive.
            value = tuple(t if t._base is None else t.clone() for t in value)
            features[m.digest] = value
            nbytes = value[0].numel() * value[0].element_size() + value[1].numel() * value[1].element_size()
            self.encoder_cache.put(CacheKey(m.digest, "vision"), value, nbytes)
        self.stats.vision_items_encoded += len(missing)
        return features
