"""Placeholder expansion: one `<|image_pad|>` / `<|video_pad|>` token per media item in a tokenized prompt
becomes the exact token run Qwen3-VL expects, with per-token modality ids and media spans.

Owns the prompt layout of media, matching HF transformers 5.17's `Qwen3VLProcessor`:
- image i: its pad token becomes t*h*w / merge^2 image pads (grid in patches).
- video j: its pad token becomes, for each temporal patch k,
      tokens("<{ts_k:.1f} seconds>") + vision_start + video_pad * (h*w / merge^2) + vision_end
  HF 5.17 replaces only the pad token, so the chat template's own vision_start / vision_end stay around
  the whole expansion. `absorb_video_vision_tokens=True` instead also replaces a vision_start / vision_end
  pair directly around the pad (the layout of the original Qwen3-VL processor, transformers 4.57).
- mm_token_type_ids: 0 text, 1 image pad, 2 video pad (HF's `create_mm_token_type_ids`: only pad tokens are
  marked; vision_start / vision_end and timestamp text are text).
- spans: one `MediaSpan` per contiguous pad run (an image, or one temporal patch of a video), in prompt order.

Token ids come from the checkpoint (config.json or the tokenizer), never from constants. Timestamp text is
tokenized on its own through `encode_text`; that equals HF's tokenization of the expanded text because the
text always sits between special tokens (in the 5.17 layout the first timestamp follows the template's
vision_start). Loops run over media items and temporal patches, never over tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .errors import PlaceholderError
from .video import PreprocessedVideo, timestamp_text

MM_TEXT, MM_IMAGE, MM_VIDEO = 0, 1, 2
MediaKind = Literal["image", "video"]


@dataclass(frozen=True)
class SpecialTokens:
    image_pad: int
    video_pad: int
    vision_start: int
    vision_end: int

    def __post_init__(self) -> None:
        values = (self.image_pad, self.video_pad, self.vision_start, self.vision_end)
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise PlaceholderError(f"special token ids must be non-negative ints, got {values}")
        if len(set(values)) != 4:
            raise PlaceholderError(f"special token ids must be distinct, got {values}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SpecialTokens:
        """From a Qwen3-VL `config.json` (top-level image_token_id, video_token_id, vision_*_token_id)."""
        keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        missing = [k for k in keys if k not in config]
        if missing:
            raise PlaceholderError(f"model config lacks special token ids {missing}")
        return cls(*(config[k] for k in keys))

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        *,
        image_token: str = "<|image_pad|>",
        video_token: str = "<|video_pad|>",
        vision_start_token: str = "<|vision_start|>",
        vision_end_token: str = "<|vision_end|>",
    ) -> SpecialTokens:
        """From a `tokenizers.Tokenizer` (token_to_id) or an HF tokenizer (convert_tokens_to_ids)."""
        lookup = getattr(tokenizer, "token_to_id", None) or getattr(tokenizer, "convert_tokens_to_ids", None)
        if lookup is None:
            raise PlaceholderError(f"cannot look up token ids in a {type(tokenizer).__name__}")
        unk = getattr(tokenizer, "unk_token_id", None)
        ids = []
        for tok in (image_token, video_token, vision_start_token, vision_end_token):
            tid = lookup(tok)
            if tid is None or (unk is not None and tid == unk):
                raise PlaceholderError(f"tokenizer has no token {tok!r}")
            ids.append(int(tid))
        return cls(*ids)


@dataclass(frozen=True)
class VideoPlaceholder:
    """What the prompt needs to know about one preprocessed video."""

    grid_thw: tuple[int, int, int]
    timestamps: tuple[float, ...]  # seconds, one per temporal patch

    @classmethod
    def from_video(cls, video: PreprocessedVideo) -> VideoPlaceholder:
        return cls(grid_thw=video.grid_thw, timestamps=tuple(video.timestamps))


@dataclass(frozen=True)
class MediaSpan:
    """A contiguous run of pad tokens in the expanded prompt."""

    start: int
    length: int
    media_index: int  # index among the prompt's images, or among its videos
    kind: MediaKind
    temporal_index: int  # temporal patch of a video; 0 for an image
    grid_thw: tuple[
        int, int, int
    ]  # this run's grid in patches: the image's grid, (1, h, w) for a video patch


@dataclass(frozen=True)
class MediaItem:
    """The token range [start, end) that replaced one media placeholder (video: timestamps and wrappers too)."""

    kind: MediaKind
    media_index: int
    start: int
    end: int


@dataclass(frozen=True)
class ExpandedPrompt:
    input_ids: np.ndarray  # [N] int64
    mm_token_type_ids: np.ndarray  # [N] int64
    spans: tuple[MediaSpan, ...]
    items: tuple[MediaItem, ...]
    image_grid_thw: np.ndarray  # [num_images, 3] int64
    video_grid_thw: np.ndarray  # [num_videos, 3] int64

    def span_starts(self) -> np.ndarray:
        return np.asarray([s.start for s in self.spans], dtype=np.int64)

    def span_grids(self) -> np.ndarray:
        return np.asarray([s.grid_thw for s in self.spans], dtype=np.int64).reshape(-1, 3)


def _grid(value: Sequence[int], merge_size: int, what: str) -> tuple[int, int, int]:
    try:
        grid = tuple(int(v) for v in value)
    except (TypeError, ValueError) as exc:
        raise PlaceholderError(f"{what}: grid_thw must be 3 ints, got {value!r}") from exc
    if len(grid) != 3 or min(grid) <= 0:
        raise PlaceholderError(f"{what}: grid_thw must be 3 positive ints, got {value!r}")
    if grid[1] % merge_size or grid[2] % merge_size:
        raise PlaceholderError(f"{what}: grid {grid} is not divisible by merge size {merge_size}")
    return grid  # type: ignore[return-value]


def expand_placeholders(
    token_ids: Sequence[int] | np.ndarray,
    *,
    special: SpecialTokens,
    merge_size: int,
    image_grids: Sequence[Sequence[int]] = (),
    videos: Sequence[VideoPlaceholder] = (),
    encode_text: Callable[[str], Sequence[int]] | None = None,
    absorb_video_vision_tokens: bool = False,
) -> ExpandedPrompt:
    """Expand each image / video pad token (in prompt order, images and videos counted separately)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise PlaceholderError(f"token_ids must be 1-D, got shape {list(ids.shape)}")
    if isinstance(merge_size, bool) or not isinstance(merge_size, int) or merge_size <= 0:
        raise PlaceholderError(f"merge_size must be a positive int, got {merge_size!r}")
    image_pos = np.flatnonzero(ids == special.image_pad)
    video_pos = np.flatnonzero(ids == special.video_pad)
    if len(image_pos) != len(image_grids):
        raise PlaceholderError(
            f"prompt has {len(image_pos)} image placeholders but {len(image_grids)} images"
        )
    if len(video_pos) != len(videos):
        raise PlaceholderError(f"prompt has {len(video_pos)} video placeholders but {len(videos)} videos")
    if len(videos) and encode_text is None:
        raise PlaceholderError("videos need encode_text to tokenize their timestamps")
    grids = [_grid(g, merge_size, f"image {i}") for i, g in enumerate(image_grids)]
    vgrids = [_grid(v.grid_thw, merge_size, f"video {j}") for j, v in enumerate(videos)]
    specials = np.asarray([special.image_pad, special.video_pad, special.vision_start, special.vision_end])

    text_cache: dict[str, np.ndarray] = {}

    def encode(text: str) -> np.ndarray:
        if text not in text_cache:
            out = np.asarray(list(encode_text(text)), dtype=np.int64)  # type: ignore[misc]
            if out.ndim != 1 or np.isin(out, specials).any():
                raise PlaceholderError(f"timestamp text {text!r} tokenized to special tokens: {out.tolist()}")
            text_cache[text] = out
        return text_cache[text]

    merge_len = merge_size * merge_size
    events = sorted(
        [(int(p), "image", i) for i, p in enumerate(image_pos)]
        + [(int(p), "video", j) for j, p in enumerate(video_pos)]
    )
    pieces: list[np.ndarray] = []
    spans: list[MediaSpan] = []
    items: list[MediaItem] = []
    out_len = 0
    cursor = 0  # next input index not yet copied

    def emit(piece: np.ndarray) -> None:
        nonlocal out_len
        pieces.append(piece)
        out_len += len(piece)

    for pos, kind, index in events:
        if kind == "image":
            emit(ids[cursor:pos])
            t, h, w = grids[index]
            n = t * h * w // merge_len
            spans.append(MediaSpan(out_len, n, index, "image", 0, grids[index]))
            items.append(MediaItem("image", index, out_len, out_len + n))
            emit(np.full(n, special.image_pad, dtype=np.int64))
            cursor = pos + 1
            continue
        video = videos[index]
        t, h, w = vgrids[index]
        if len(video.timestamps) != t:
            raise PlaceholderError(
                f"video {index}: {len(video.timestamps)} timestamps for {t} temporal patches"
            )
        start, stop = pos, pos + 1
        if (
            absorb_video_vision_tokens
            and pos > cursor
            and pos + 1 < len(ids)
            and ids[pos - 1] == special.vision_start
            and ids[pos + 1] == special.vision_end
        ):
            start, stop = pos - 1, pos + 2
        emit(ids[cursor:start])
        item_start = out_len
        n = h * w // merge_len
        pads = np.full(n, special.video_pad, dtype=np.int64)
        for k, seconds in enumerate(video.timestamps):
            emit(encode(timestamp_text(seconds)))
            emit(np.asarray([special.vision_start], dtype=np.int64))
            spans.append(MediaSpan(out_len, n, index, "video", k, (1, h, w)))
            emit(pads)
            emit(np.asarray([special.vision_end], dtype=np.int64))
        items.append(MediaItem("video", index, item_start, out_len))
        cursor = stop
    emit(ids[cursor:])

    input_ids = np.concatenate(pieces) if pieces else ids.copy()
    mm = np.zeros_like(input_ids)
    mm[input_ids == special.image_pad] = MM_IMAGE
    mm[input_ids == special.video_pad] = MM_VIDEO
    return ExpandedPrompt(
        input_ids=input_ids,
        mm_token_type_ids=mm,
        spans=tuple(spans),
        items=tuple(items),
        image_grid_thw=np.asarray(grids, dtype=np.int64).reshape(-1, 3),
        video_grid_thw=np.asarray(vgrids, dtype=np.int64).reshape(-1, 3),
    )
