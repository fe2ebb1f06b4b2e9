"""Encoded image bytes -> everything the engine needs about that image, through the preprocessing cache.

Owns the order raw-byte digest -> cache lookup -> decode / resize / normalize / patchify -> content digest,
so every entry path (offline, in-process, HTTP) shares one cache and one identity per image.
Cached values are shared between requests: treat their tensors as read-only (copy before any in-place op).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from .cache import CacheKey, PreprocessCache
from .config import ImageProcessorConfig, VideoProcessorConfig
from .digest import image_digest, raw_digest
from .image import DEFAULT_LIMITS, DecodeLimits, preprocess_image
from .pixels import PatchPixels


@dataclass(frozen=True)
class PreparedImage:
    pixels: PatchPixels  # the resized uint8 frame, patchified and normalized where it is encoded
    grid_thw: tuple[int, int, int]
    digest: bytes  # content digest of the preprocessed pixels (media_digest)
    raw_digest: bytes  # digest of the encoded bytes
    resized_size: tuple[int, int]
    image_size: tuple[int, int]  # (height, width) as decoded, before resize: what the pixel budget counted

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)

    @property
    def pixel_values(self) -> torch.Tensor:
        """float32 [gh*gw, C*T*p*p], normalized as HF does (computed on each access)."""
        return self.pixels.normalized()

    @property
    def nbytes(self) -> int:
        return self.pixels.nbytes + 256


def media_namespace(model_id: str, config: ImageProcessorConfig | VideoProcessorConfig) -> str:
    """Unambiguous (JSON-encoded pair) namespace of a model id and processor settings."""
    return json.dumps([model_id, config.fingerprint()], separators=(",", ":"))


def prepare_image(
    data: bytes,
    config: ImageProcessorConfig,
    *,
    model_id: str,
    cache: PreprocessCache[PreparedImage] | None = None,
    limits: DecodeLimits = DEFAULT_LIMITS,
) -> PreparedImage:
    """Preprocess encoded image bytes (or reuse the cached result for the same bytes and settings)."""
    key = CacheKey(raw_digest(data), media_namespace(model_id, config))

    def compute() -> tuple[PreparedImage, int]:
        pre = preprocess_image(data, config, limits)
        prepared = PreparedImage(
            pixels=pre.pixels,
            grid_thw=pre.grid_thw,
            digest=image_digest(pre, model_id=model_id, config=config),
            raw_digest=key.raw_digest,
            resized_size=pre.resized_size,
            image_size=pre.image_size,
        )
        return prepared, prepared.nbytes

    if cache is None:
        return compute()[0]
    return cache.get_or_compute(key, compute)
