"""Rank 0's half of a step: the scheduler's slices and the KV manager's page tables as a `StepPayload`.

Owns what a forward's rows are: each slice's token ids and M-RoPE positions (`token_positions`: the prompt's own
positions, then text positions continued by the rope delta), its page table and whether it samples; in
deterministic mode every sequence alone, in page-aligned tiles of exactly one page of rows (`deterministic_tiles`,
half of invariant 12: every token is always computed in the same tile, at the same row, with the same shapes).
Which captured graphs run a forward is the runner's call (`graph_for`); this module only records it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np
import torch

from ..kv.manager import KVCacheManager
from ..kv.transfers import TransferPlan
from .scheduler import ScheduledSlice
from .step_payload import ForwardInput, MediaSlice, PieceInput, StepPayload, media_slices, media_work


def token_positions(request, start: int, end: int) -> torch.Tensor:
    """M-RoPE positions [3, end - start] of tokens [start, end): the prompt's own, then text positions
    continued with the rope delta for generated tokens."""
    prompt = request.prompt
    n_prompt = len(prompt.token_ids)
    if start >= n_prompt:  # every decode step of every sequence: NumPy, no torch dispatch per call
        row = np.arange(start + prompt.rope_delta, end + prompt.rope_delta, dtype=np.int64)
        return torch.from_numpy(np.repeat(row[None, :], 3, axis=0))
    out = torch.empty(3, end - start, dtype=torch.int64)
    split = min(max(start, n_prompt), end)
    if split > start:
        out[:, : split - start] = torch.as_tensor(prompt.positions)[:, start:split]
    if end > split:
        out[:, split - start :] = torch.arange(split, end, dtype=torch.int64) + prompt.rope_delta
    return out


def deterministic_tiles(slices: Sequence[ScheduledSlice], page_size: int) -> list[list[tuple]]:
    """Every sequence alone, in page-aligned tiles of exactly one page of rows (padded), recomputing the frontier
    page from its start: every token is always computed in the same tile at the same row with the same shapes,
    whatever the batch, the chunking or the cache did. Each tile: [(slice, start, end, pad, samples)]."""
    tiles = []
    for s in slices:
        tile_start = (s.start // page_size) * page_size
        while tile_start < s.end:
            tile_end = min(tile_start + page_size, s.end)
            last = tile_end == s.end
            tiles.append([(s, tile_start, tile_end, tile_start + page_size - tile_end, s.sample and last)])
            tile_start += page_size
    return tiles


def build_payload(plan: TransferPlan, slices: Sequence[ScheduledSlice], kv: KVCacheManager, *, page_size: int,
                  deterministic: bool, graph_for: Callable[[list[PieceInput], list[MediaSlice]], str],
                  is_encoder_cached: Callable[[bytes], bool], media_ahead: Sequence = (),
                  pending: Collection[str] = ()) -> StepPayload:
    """The step as data: the plan, the forwards (one, or one per deterministic tile) and the media work (what the
    forwards read, then the items encoded ahead). A `pending` request's row has a placeholder id (its token comes
    from the device) and samples."""
    pending = set(pending)
    if not slices:
        return StepPayload(plan, [], [])
    if deterministic:
        groups = deterministic_tiles(slices, page_size)
    else:
        groups = [[(s, s.start, s.end, 0, s.sample or s.request.request_id in pending) for s in slices]]
    forwards, items = [], []
    for group in groups:
        pieces = [
            PieceInput(
                [0] if s.request.request_id in pending else s.request.token_ids_between(start, end),
                token_positions(s.request, start, end + pad),
                start,
                end,
                pad,
                [page for _, page in kv.seqs[s.request.request_id].pages],
                sample,
            )
            for s, start, end, pad, sample in group
        ]
        media, used = media_slices(pieces, [g[0].request for g in group])
        items.extend(used)
        forwards.append(ForwardInput(pieces, media, graph=graph_for(pieces, media)))
    items.extend(media_ahead)  # media_work keeps one entry per digest, the forwards' first
    beside_decodes = any(s.start >= s.request.num_prompt_tokens for s in slices)
    return StepPayload(plan, forwards, media_work(items, is_encoder_cached), beside_decodes, len(pending))
