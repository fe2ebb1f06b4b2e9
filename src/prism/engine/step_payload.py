"""What one step asks of every rank's device: a plain, picklable description built on rank 0.

Owns *every rank runs the same step* (invariant 5 across ranks, and invariant 10's consequence): the
transfer plan (executed on every rank in the same order), each forward's rows (token ids, M-RoPE
positions, page table, context length, which row is sampled) and the media work. Built once from the
scheduler's slices and the KV manager's page tables, it is all a follower rank needs; the single-GPU
path runs through it too. Media items carry their pixels only when they must be encoded (not in the
encoder cache, which is kept identical on every rank): a full prefix hit has no media work, so no
pixels travel; and each rank receives only the pixels of the items it encodes (`for_rank`, the
encoder-DP assignment). Tensors are referenced, never copied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..distributed.encoder_dp import assign_media
from ..kv.transfers import TransferPlan
from ..media.pixels import PatchPixels


@dataclass(frozen=True)
class PieceInput:
    """Positions [start, end) of one sequence, then `pad` filler rows (deterministic tiles)."""

    token_ids: list[int]  # end - start real ids (the filler rows get id 0)
    positions: torch.Tensor  # [3, end + pad - start] int64, on the CPU
    start: int
    end: int
    pad: int
    pages: list[int]  # the sequence's physical pages in logical order
    sample: bool

    @property
    def num_rows(self) -> int:
        return self.end + self.pad - self.start

    def slots(self, page_size: int) -> np.ndarray:
        """int64 KV slot of each row, positions [start, end + pad): its page's slot base plus its row in the page
        (a deterministic tile's filler rows write the rest of its own frontier page, as the eager forward does)."""
        pos = np.arange(self.start, self.end + self.pad, dtype=np.int64)
        pages = np.asarray(self.pages, dtype=np.int64)
        return pages[pos // page_size] * page_size + pos % page_size


@dataclass(frozen=True)
class MediaSlice:
    """Rows [row, row + length) of a forward take features [offset, offset + length) of item `digest`."""

    row: int
    digest: bytes
    offset: int
    length: int


@dataclass(frozen=True)
class ForwardInput:
    pieces: list[PieceInput]
    media: list[MediaSlice]
    # Which captured CUDA graphs replay this forward: "rows" (one-token rows: decodes, short prefills without
    # media), "packed" (the packed forward of a mixed step), "" (none: an eager forward).
    graph: str = ""


@dataclass(frozen=True)
class MediaWork:
    """A media item a forward of this step reads. encode: its features are not in the encoder cache, so
    the ranks encode it this step; pixels: present only on the rank that encodes it."""

    digest: bytes
    grid: tuple[int, int, int]
    encode: bool
    pixels: PatchPixels | torch.Tensor | None  # an image's uint8 frame or a video's float32 patches


@dataclass(frozen=True)
class StepPayload:
    plan: TransferPlan
    forwards: list[ForwardInput]
    media: list[MediaWork]
    # Some row of the step decodes a running request: no vision-graph capture in it (`VisionGraphs.encode`).
    beside_decodes: bool = False
    # Async scheduling under TP: the first this many rows are fed tokens rank 0 sampled on its device, which no
    # host has read; every rank takes them from rank 0 by a broadcast before the forward (`ModelRunner.run`).
    device_token_rows: int = 0

    def for_rank(self, rank: int, world_size: int) -> StepPayload:
        """This payload as rank `rank` needs it: the pixels of the items other ranks encode left out, and for a
        follower, none of rank 0's bookkeeping (the plan's pinned pages: 70 KB of a 4,000-move plan's 100 KB)."""
        payload = self
        if rank != 0 and self.plan.pinned:
            payload = replace(self, plan=replace(self.plan, pinned=[]))
        to_encode = [m for m in payload.media if m.encode]
        if world_size == 1 or not to_encode:
            return payload
        owner = dict(zip((m.digest for m in to_encode),
                         assign_media([g[0] * g[1] * g[2] for g in (m.grid for m in to_encode)], world_size),
                         strict=True))
        media = [m if not m.encode or owner[m.digest] == rank else replace(m, pixels=None) for m in payload.media]
        return replace(payload, media=media)


def media_slices(pieces: Sequence[PieceInput], requests: Sequence) -> tuple[list[MediaSlice], list]:
    """The media rows of a packed forward, and the media items they read (first use order, by digest)."""
    slices, items = [], {}
    row = 0
    for p, request in zip(pieces, requests, strict=True):
        if p.start >= len(request.prompt.token_ids):  # generated tokens only (decodes): media live in the prompt
            row += p.num_rows
            continue
        for item in request.prompt.media:
            item_offset = 0
            for span_start, span_len in item.spans:
                lo, hi = max(p.start, span_start), min(p.end, span_start + span_len)
                if lo < hi:
                    slices.append(MediaSlice(row + lo - p.start, item.digest, item_offset + lo - span_start, hi - lo))
                    items.setdefault(item.digest, item)
                item_offset += span_len
        row += p.num_rows
    return slices, list(items.values())


def media_work(items: Sequence, is_cached: Callable[[bytes], bool]) -> list[MediaWork]:
    """One MediaWork per distinct item; pixels only for items not in the encoder cache."""
    out, seen = [], set()
    for item in items:
        if item.digest in seen:
            continue
        seen.add(item.digest)
        encode = not is_cached(item.digest)
        out.append(MediaWork(item.digest, tuple(int(v) for v in item.grid_thw), encode,
                             item.pixels if encode else None))
    return out
