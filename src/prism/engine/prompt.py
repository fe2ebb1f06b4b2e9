"""A prompt as the engine receives it: token ids, modality ids, M-RoPE positions and the placed media.

Owns the link between a prompt and the prefix cache's identity: `PreparedPrompt.kv_content()` gives the
tokens and one `MediaSpan(start, length, digest)` per pad run, which is what page keys hash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..kv.content import MediaSpan, SeqContent
from ..media.pixels import PatchPixels, pixels_on
from .chat import InputError


@dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class PreparedMedia:
    """One image or video of a prompt, preprocessed and placed.

    `spans` are the pad runs in the prompt as (start, length): one for an image, one per temporal patch for
    a video. `span_digests[i]` is what the prefix cache keys run i on: the image digest, or for a video
    `media_preparation.video_span_digest(digest, i)`. `kv_spans` pairs them as `prism.kv.content.MediaSpan`s.
    """

    kind: Literal["image", "video"]
    index: int  # among the prompt's images, or among its videos
    # an image's resized uint8 frame (patchified and normalized on the encoding device) or a video's float32
    # patches [t*h*w, C*T*p*p]; read-only (may be shared through the cache)
    pixels: PatchPixels | torch.Tensor
    grid_thw: tuple[int, int, int]  # in patches
    digest: bytes  # media content digest (prism.media.digest)
    spans: tuple[tuple[int, int], ...]
    span_digests: tuple[bytes, ...]
    timestamps: tuple[float, ...] = ()  # video: seconds per temporal patch

    def __post_init__(self) -> None:
        if not self.spans or len(self.spans) != len(self.span_digests):
            raise InputError(
                f"{self.kind} {self.index}: {len(self.spans)} spans, {len(self.span_digests)} digests"
            )

    @property
    def pixel_values(self) -> torch.Tensor:
        """float32 [t*h*w, C*T*p*p] on the CPU, normalized as HF does."""
        return pixels_on(self.pixels, "cpu")

    @property
    def num_tokens(self) -> int:
        return sum(length for _, length in self.spans)

    @property
    def start(self) -> int:
        """First pad token of the item."""
        return self.spans[0][0]

    @property
    def end(self) -> int:
        """One past the last pad token (a video's timestamp text and wrappers lie inside [start, end))."""
        start, length = self.spans[-1]
        return start + length

    @property
    def kv_spans(self) -> tuple[MediaSpan, ...]:
        return tuple(MediaSpan(s, n, d) for (s, n), d in zip(self.spans, self.span_digests, strict=True))


@dataclass(frozen=True, eq=False)
class PreparedPrompt:
    """Everything the engine needs about a prompt; `text` is the prompt before placeholder expansion."""

    token_ids: list[int]
    mm_token_type_ids: torch.Tensor  # [N] int64: 0 text, 1 image pad, 2 video pad
    positions: torch.Tensor  # [3, N] int64 M-RoPE (t, h, w)
    rope_delta: int  # a token appended at sequence index i >= N gets position i + rope_delta
    media: tuple[PreparedMedia, ...]  # prompt order
    text: str | None = None
    # (uuid, cache key, content digest) of each image sent with a uuid: the names the prompt binds when the engine
    # accepts it (`InputProcessor.bind_names`), so a refused request names nothing.
    image_names: tuple[tuple[str, Any, bytes], ...] = ()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_media_tokens(self) -> int:
        return sum(m.num_tokens for m in self.media)

    @property
    def images(self) -> tuple[PreparedMedia, ...]:
        return tuple(m for m in self.media if m.kind == "image")

    @property
    def videos(self) -> tuple[PreparedMedia, ...]:
        return tuple(m for m in self.media if m.kind == "video")

    @property
    def image_grid_thw(self) -> torch.Tensor:
        """[num_images, 3] int64, images in prompt order."""
        return torch.tensor([m.grid_thw for m in self.images], dtype=torch.int64).reshape(-1, 3)

    @property
    def video_grid_thw(self) -> torch.Tensor:
        return torch.tensor([m.grid_thw for m in self.videos], dtype=torch.int64).reshape(-1, 3)

    def media_spans(self) -> tuple[MediaSpan, ...]:
        """One MediaSpan(start, length, digest) per pad run, in prompt order."""
        return tuple(s for m in self.media for s in m.kv_spans)

    def kv_content(self) -> SeqContent:
        """Token ids (a fresh list: decode appends to it) and one MediaSpan per pad run."""
        return SeqContent(tokens=list(self.token_ids), media=self.media_spans())

    def extended(self, token_ids: list[int]) -> PreparedPrompt:
        """This prompt followed by more text tokens (e.g. generated reasoning), positions continued."""
        n, k = len(self.token_ids), len(token_ids)
        more = (torch.arange(n, n + k, dtype=torch.int64) + self.rope_delta).expand(3, k)
        return PreparedPrompt(
            token_ids=self.token_ids + list(token_ids),
            mm_token_type_ids=torch.cat([self.mm_token_type_ids, torch.zeros(k, dtype=torch.int64)]),
            positions=torch.cat([self.positions, more], dim=1),
            rope_delta=self.rope_delta,
            media=self.media,
            image_names=self.image_names,
        )

    def prefix(self, length: int) -> PreparedPrompt:
        """The first `length` tokens as a prompt of their own (a shared material); media may not be cut."""
        if not 0 < length <= len(self.token_ids):
            raise InputError(f"prefix length {length} outside [1, {len(self.token_ids)}]")
        if any(m.start < length < m.end for m in self.media):
            raise InputError(f"a prefix of {length} tokens would cut a media item")
        return PreparedPrompt(
            token_ids=self.token_ids[:length],
            mm_token_type_ids=self.mm_token_type_ids[:length],
            positions=self.positions[:, :length],
            rope_delta=self.rope_delta,
            media=tuple(m for m in self.media if m.end <= length),
            image_names=self.image_names,
        )


