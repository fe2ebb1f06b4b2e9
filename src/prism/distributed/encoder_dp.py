"""Vision encoder data parallelism: whole media items spread over the ranks, features gathered back.

Owns *encoder-DP == replicated encoder*: every item is encoded by exactly one rank (whole items, never
split), and after one all-gather every rank holds every item's main and DeepStack features in the
original item order. Assignment is deterministic from the items' patch counts alone (largest first onto
the least loaded rank, ties to the lower rank), so every rank computes the same assignment without
talking. With one rank it is the plain encoder call (no packing, no collective).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..media.pixels import PatchPixels, batch_pixels_on
from ..model.qwen3_vl import Qwen3VLModel
from ..model.vision import VisionOutput
from .tensor_parallel import TPGroup

Grid = tuple[int, int, int]
Features = tuple[torch.Tensor, torch.Tensor]  # embeds [n, H], deepstack [k, n, H]
Encode = Callable[[torch.Tensor, Sequence[Sequence[int]]], VisionOutput]


def assign_media(patch_counts: Sequence[int], world_size: int) -> list[int]:
    """The rank that encodes each item: largest item first onto the least loaded rank (ties: the
    earlier item first, the lower rank)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0] * world_size
    owner = [0] * len(patch_counts)
    for i in sorted(range(len(patch_counts)), key=lambda i: (-patch_counts[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += patch_counts[i]
    return owner


def _encode_batches(model: Qwen3VLModel, encode: Encode, pixels: list[PatchPixels | torch.Tensor], grids: list[Grid],
                    one_at_a_time: bool) -> list[Features]:
    batches = [[i] for i in range(len(grids))] if one_at_a_time else ([list(range(len(grids)))] if grids else [])
    out: list[Features] = []
    for batch in batches:
        # Images go to the device as uint8 frames, normalized and cut into patches there (`batch_pixels_on`).
        x = batch_pixels_on([pixels[i] for i in batch], model.device, model.dtype)
        enc = encode(x, [list(grids[i]) for i in batch])
        start = 0
        for count in enc.tokens_per_item:
            out.append((enc.embeds[start : start + count], enc.deepstack[:, start : start + count]))
            start += count
    return out


def encode_media_items(
    model: Qwen3VLModel,
    grids: Sequence[Grid],
    pixels: Sequence[PatchPixels | torch.Tensor],
    group: TPGroup,
    *,
    one_at_a_time: bool = False,
    encode: Encode | None = None,
) -> list[Features]:
    """Features of every item, in item order, on every rank. All ranks must call it with the same grids
    (pixels are read only for the items this rank encodes). one_at_a_time: each item alone (batch
    invariance for deterministic mode). `encode`: what runs the encoder over a batch's patches (default
    `model.encode_media`; the runner's vision graphs replay it)."""
    encode = encode or model.encode_media
    grids = [tuple(int(v) for v in g) for g in grids]
    if group.world_size == 1:
        return _encode_batches(model, encode, list(pixels), grids, one_at_a_time)
    merge = model.config.vision.spatial_merge_size
    tokens = [t * h * w // merge**2 for t, h, w in grids]
    owner = assign_media([t * h * w for t, h, w in grids], group.world_size)
    mine = [i for i, r in enumerate(owner) if r == group.rank]
    local = _encode_batches(model, encode, [pixels[i] for i in mine], [grids[i] for i in mine], one_at_a_time)
    # One collective: [1 + k, rows, H] (main then DeepStack) padded to the busiest rank's rows.
    per_rank = [sum(tokens[i] for i, r in enumerate(owner) if r == rank) for rank in range(group.world_size)]
    width = max(per_rank)
    k = len(model.config.vision.deepstack_visual_indexes)
    hidden = model.config.text.hidden_size
    packed = torch.zeros(1 + k, width, hidden, dtype=model.dtype, device=group.device)
    row = 0
    for embeds, deepstack in local:
        n = embeds.shape[0]
        packed[0, row : row + n] = embeds
        packed[1:, row : row + n] = deepstack
        row += n
    parts = group.all_gather(packed)
    out: list[Features | None] = [None] * len(grids)
    offsets = [0] * group.world_size
    for i, rank in enumerate(owner):
        a, b = offsets[rank], offsets[rank] + tokens[i]
        offsets[rank] = b
        block = parts[rank][:, a:b].to(model.device)
        out[i] = (block[0], block[1:])
    return out  # type: ignore[return-value]
