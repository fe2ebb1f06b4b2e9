"""Qwen3-VL multimodal RoPE position ids (t, h, w rows) for prompts mixing text, images and videos, and
the positions of tokens appended after the prompt.

Owns: position ids equal to HF transformers 5.17 `Qwen3VLModel.get_rope_index` for one unpadded sequence:
- text continues one position per token from the current position p;
- a media run (an image, or ONE temporal patch of a video: Qwen3-VL splits videos per temporal patch because
  timestamps text separates them) with grid (t, h, w) in patches and merge m starts at p and gives token
  (ti, hi, wi) (row-major over t, h/m, w/m) the ids (p + ti, p + hi, p + wi); afterwards
  p += max(h, w) // m (not counting t, exactly as HF);
- rope_delta = max(all ids) + 1 - num_tokens; a token at sequence index i >= num_tokens (decode or
  continuation) gets id i + rope_delta on all three rows.
Everything is vectorized over tokens (cumsum for text, one slice assignment of a cached per-grid pattern
per media run); the only Python-level work is per call and per media run.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch


class MRopeLayoutError(ValueError):
    """Media runs and grids do not describe the token sequence (counts, lengths, overlaps, bad grids)."""


def _as_long(
    x: torch.Tensor | np.ndarray | Sequence[int] | Sequence[Sequence[int]], name: str
) -> torch.Tensor:
    try:
        t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
    except (TypeError, ValueError) as exc:
        raise MRopeLayoutError(f"{name} must be integers, got {type(x).__name__}") from exc
    if t.numel() == 0:  # an empty list arrives as float64 from numpy
        return t.to(device="cpu", dtype=torch.int64)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise MRopeLayoutError(f"{name} must be integers, got {t.dtype}")
    return t.to(device="cpu", dtype=torch.int64)


def _grids(x: torch.Tensor | np.ndarray | Sequence[Sequence[int]] | None, name: str) -> torch.Tensor:
    """`_grids_np` as an int64 tensor."""
    return torch.as_tensor(_grids_np(x, name))


def _as_long_np(
    x: torch.Tensor | np.ndarray | Sequence[int] | Sequence[Sequence[int]], name: str
) -> np.ndarray:
    """`_as_long` as a NumPy array (read it, never write it: it may share memory with `x`). Plain int64 input
    takes a fast path; anything else goes through `_as_long`, so acceptance and errors are the same."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.int64 and x.device.type == "cpu" and x.layout == torch.strided:
            return x.numpy()
        return _as_long(x, name).numpy()
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise MRopeLayoutError(f"{name} must be integers, got {type(x).__name__}") from exc
    if a.dtype == np.int64:
        return a
    if a.size == 0 and a.dtype == np.float64:  # an empty list
        return a.astype(np.int64)
    return _as_long(x, name).numpy()


def _grids_np(x: torch.Tensor | np.ndarray | Sequence[Sequence[int]] | None, name: str) -> np.ndarray:
    """`_grids` as a NumPy array (same checks and errors)."""
    if x is None:
        return np.zeros((0, 3), dtype=np.int64)
    g = _as_long_np(x, name)
    if g.size == 0:
        return g.reshape(0, 3)
    if g.ndim != 2 or g.shape[1] != 3:
        raise MRopeLayoutError(f"{name} must be [n, 3] (t, h, w), got shape {list(g.shape)}")
    if np.count_nonzero(g <= 0):
        raise MRopeLayoutError(f"{name} must be positive, got {g.tolist()}")
    return g


@functools.lru_cache(maxsize=32)
def _run_offsets(length: int, lhw: int, lw: int) -> np.ndarray:
    """[3, length] read-only ids of a run's tokens minus their text-like ids p + k (k = index in the run):
    token k is (ti, hi, wi) = (k // lhw, (k % lhw) // lw, k % lw), row-major over (t, h/m, w/m) with
    lhw = (h/m) * (w/m) and lw = w/m, and gets the ids p + (ti, hi, wi)."""
    local = np.arange(length, dtype=np.int64)
    offsets = np.stack([local // lhw, (local % lhw) // lw, local % lw])
    offsets -= local
    offsets.setflags(write=False)
    return offsets


def split_video_grids(
    video_grid_thw: torch.Tensor | np.ndarray | Sequence[Sequence[int]] | None,
) -> torch.Tensor:
    """[V, 3] video grids -> one (1, h, w) row per temporal patch, in order (what Qwen3-VL's index does)."""
    g = _grids(video_grid_thw, "video_grid_thw")
    out = torch.repeat_interleave(g, g[:, 0], dim=0)
    out[:, 0] = 1
    return out


def mrope_positions_from_spans(
    num_tokens: int,
    span_starts: torch.Tensor | np.ndarray | Sequence[int],
    span_grids: torch.Tensor | np.ndarray | Sequence[Sequence[int]],
    *,
    spatial_merge_size: int,
    span_lengths: torch.Tensor | np.ndarray | Sequence[int] | None = None,
) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] int64 and rope_delta for media runs starting at `span_starts` (sorted) with
    grids `span_grids` [R, 3] in patches (videos already split per temporal patch). If `span_lengths` is
    given, each must equal the grid's token count."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
        raise MRopeLayoutError(f"num_tokens must be a positive int, got {num_tokens!r}")
    m = spatial_merge_size
    if isinstance(m, bool) or not isinstance(m, int) or not 0 < m < 2**31:
        raise MRopeLayoutError(f"spatial_merge_size must be a positive int below 2**31, got {m!r}")
    # NumPy throughout: per-call tensors of a few thousand ints cost more in torch's CPU dispatch than in the math.
    starts = _as_long_np(span_starts, "span_starts").reshape(-1)
    grids = _grids_np(span_grids, "span_grids")
    if grids.shape[0] != starts.shape[0]:
        raise MRopeLayoutError(f"{starts.shape[0]} span starts but {grids.shape[0]} span grids")
    merged, rem = np.divmod(grids[:, 1:], m)  # (h/m, w/m) per run
    if np.count_nonzero(rem):
        raise MRopeLayoutError(f"span grids {grids.tolist()} are not divisible by merge size {m}")
    lh, lw = merged[:, 0], merged[:, 1]
    lhw = lh * lw
    lengths = grids[:, 0] * lhw
    if np.count_nonzero(lengths <= 0):  # positive grids: only an int64 overflow gets here
        raise MRopeLayoutError(f"span grids {grids.tolist()} give runs of {lengths.tolist()} tokens")
    if span_lengths is not None:
        given = _as_long_np(span_lengths, "span_lengths").reshape(-1)
        if given.shape != lengths.shape or np.count_nonzero(given != lengths):
            raise MRopeLayoutError(
                f"media runs have {given.tolist()} tokens but their grids need {lengths.tolist()}"
            )
    ends = starts + lengths
    if starts.size:
        if starts[0] < 0 or ends[-1] > num_tokens or np.count_nonzero(starts[1:] < ends[:-1]):
            raise MRopeLayoutError(
                f"media spans (starts {starts.tolist()}, lengths {lengths.tolist()}) overlap, are unsorted "
                f"or leave the {num_tokens}-token sequence"
            )

    # Text token i sits at i + (sum over earlier runs of advance - length); a run starts at that shift too,
    # which stays constant over the run, so a run's ids are these "text" ids plus offsets from its grid alone.
    if not starts.size:
        positions_np = np.empty((3, num_tokens), dtype=np.int64)
        positions_np[:] = np.arange(num_tokens, dtype=np.int64)
        return torch.from_numpy(positions_np), 0
    step = np.maximum(lh, lw) - lengths  # advance max(h, w) // m, minus the run's length
    shift_at = np.zeros(num_tokens + 1, dtype=np.int64)
    np.add.at(shift_at, ends, step)
    base = np.cumsum(shift_at[:num_tokens])
    base += np.arange(num_tokens, dtype=np.int64)
    offsets = np.zeros((3, num_tokens), dtype=np.int64)
    # One slice per run (runs are few), no per-token index arrays.
    for s0, n_tok, lhw_i, lw_i in zip(starts.tolist(), lengths.tolist(), lhw.tolist(), lw.tolist(), strict=True):
        offsets[:, s0 : s0 + n_tok] = _run_offsets(n_tok, lhw_i, lw_i)
    positions_np = np.add(base, offsets, out=offsets)
    positions = torch.from_numpy(positions_np)
    rope_delta = int(positions_np.max()) + 1 - num_tokens
    return positions, rope_delta


def mrope_positions_from_token_types(
    mm_token_type_ids: torch.Tensor | np.ndarray | Sequence[int],
    *,
    image_grid_thw: torch.Tensor | np.ndarray | Sequence[Sequence[int]] | None = None,
    video_grid_thw: torch.Tensor | np.ndarray | Sequence[Sequence[int]] | None = None,
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """From HF-style mm_token_type_ids (0 text, 1 image, 2 video): each maximal run of 1s takes the next image
    grid, each run of 2s the next video temporal patch. Counts and run lengths must match the grids."""
    types = _as_long(mm_token_type_ids, "mm_token_type_ids").reshape(-1)
    n = types.numel()
    if n == 0:
        raise MRopeLayoutError("empty token sequence")
    if bool(((types < 0) | (types > 2)).any()):
        raise MRopeLayoutError("mm_token_type_ids must be 0 (text), 1 (image) or 2 (video)")
    boundaries = torch.cat([torch.zeros(1, dtype=torch.bool), types[1:] != types[:-1]])
    run_starts = torch.nonzero(boundaries).reshape(-1)
    run_starts = torch.cat([torch.zeros(1, dtype=torch.int64), run_starts])
    run_lengths = torch.diff(torch.cat([run_starts, torch.tensor([n])]))
    run_types = types[run_starts]
    media = run_types != 0
    starts, lengths, kinds = run_starts[media], run_lengths[media], run_types[media]
    images = _grids(image_grid_thw, "image_grid_thw")
    videos = split_video_grids(video_grid_thw)
    n_img, n_vid = int((kinds == 1).sum()), int((kinds == 2).sum())
    if n_img != images.shape[0] or n_vid != videos.shape[0]:
        raise MRopeLayoutError(
            f"sequence has {n_img} image runs and {n_vid} video runs but {images.shape[0]} image grids and "
            f"{videos.shape[0]} video temporal patches (adjacent media need a text token between them)"
        )
    grids = torch.zeros(starts.numel(), 3, dtype=torch.int64)
    grids[kinds == 1] = images
    grids[kinds == 2] = videos
    return mrope_positions_from_spans(
        n, starts, grids, spatial_merge_size=spatial_merge_size, span_lengths=lengths
    )


def mrope_positions(
    input_ids: torch.Tensor | np.ndarray | Sequence[int],
    *,
    image_token_id: int,
    video_token_id: int,
    image_grid_thw: torch.Tensor | np.ndarray | Sequence[Sequence[int]] | None = None,
    video_grid_thw: torch.Tensor | np.ndarray | Sequence[Sequence[int]] | None = None,
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """Positions [3, N] int64 and rope_delta of one prompt from its token ids (pad ids from the checkpoint)."""
    ids = _as_long(input_ids, "input_ids").reshape(-1)
    if image_token_id == video_token_id:
        raise MRopeLayoutError("image and video token ids must differ")
    types = torch.zeros_like(ids)
    types[ids == image_token_id] = 1
    types[ids == video_token_id] = 2
    return mrope_positions_from_token_types(
        types,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        spatial_merge_size=spatial_merge_size,
    )


def decode_positions(num_tokens_so_far: int, rope_delta: int, num_new_tokens: int = 1) -> torch.Tensor:
    """[3, num_new_tokens] ids of tokens appended at sequence indices num_tokens_so_far... (decode steps or a
    text continuation after the prompt): index + rope_delta on every row."""
    if num_tokens_so_far < 0 or num_new_tokens < 0:
        raise MRopeLayoutError(f"bad continuation: {num_tokens_so_far} tokens so far, {num_new_tokens} new")
    pos = torch.arange(num_tokens_so_far, num_tokens_so_far + num_new_tokens, dtype=torch.int64) + int(
        rope_delta
    )
    return pos.unsqueeze(0).expand(3, -1).contiguous()


def batched_decode_positions(num_tokens_so_far: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
    """[3, B] ids of the next token of B sequences (device tensors, no host sync)."""
    if num_tokens_so_far.shape != rope_deltas.shape or num_tokens_so_far.ndim != 1:
        raise MRopeLayoutError(
            f"expected two [B] tensors, got {list(num_tokens_so_far.shape)} and {list(rope_deltas.shape)}"
        )
    pos = num_tokens_so_far.to(torch.int64) + rope_deltas.to(torch.int64)
    return pos.unsqueeze(0).expand(3, -1).contiguous()
