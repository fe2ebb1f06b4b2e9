"""Content digests of media: the identity the prefix cache and the encoder cache key on.

Owns the invariant "same pixels <=> same digest": `media_digest` hashes the DECODED, PREPROCESSED pixels,
so the same picture stored as PNG, lossless JPEG/WebP or with other metadata bytes gives one digest, while
any pixel change, grid change or processor-setting change gives another. For an image the pixels hashed are
the uint8 frame after smart resize, R, G, B and a zero byte per pixel (`PreprocessedImage.resized_rgb0`, the
frame the image is kept as): pixel_values is a one-to-one function of them and the settings (which are hashed
too), and they are 6x fewer bytes than the float32, temporally repeated pixel_values. Videos hash pixel_values.
`raw_digest` hashes the encoded file bytes (the cheap key of the CPU preprocessing cache).

Hash: BLAKE3 with a 256-bit output (collision resistant, so a client cannot make its picture take another's
cached KV; vLLM keys its multimodal cache the same way). It is the hot path's largest cost when a client sends
pixels again (8 images of 448x448 are 4.8 MB): on the H200's host SHA-256 hashed them in ~2.5 ms; on the CPU
machine BLAKE3 hashes one such image 3.4x faster than SHA-256 (0.10 vs 0.33 ms, one core). Never truncated below 128 bits by callers (`DIGEST_SIZE`).

Framing (explicit, so no two different field lists can produce the same byte stream; a peer's collision
bug came from hashing unframed concatenations). The hash input is a sequence of fields, each encoded as

    u64le(len(name)) || name || u64le(len(value)) || value

with names ASCII and fixed, values raw bytes, in this order:
  media_digest: scheme ("prism.media.v4"), model_id (UTF-8), settings (processor fingerprint, UTF-8),
                kind ("image" | "video"), grid (3 x i64le: t, h, w), dtype (numpy dtype.str, e.g. "<f4"),
                shape (i64le per dim), [timestamps (f64le per temporal patch), video only], pixels (C-order bytes).
  raw_digest:   scheme ("prism.raw.v3"), bytes (the encoded file).
  pixels_digest (the preprocessing cache's key of an image given as pixels, not as a file):
                scheme ("prism.rgbx8.v1" for a PIL image's own storage, R, G, B and a padding byte per pixel,
                hashed in place (`media.pil_pixels`); "prism.rgb8.v3" for a uint8 array, or a PIL image Pillow
                does not export), shape (i64le per dim), pixels. The schemes keep the two layouts apart; the
                same picture reaching both ways is prepared twice and gets one `media_digest`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Protocol

import blake3
import numpy as np
import torch
from PIL import Image

from .config import ImageProcessorConfig, VideoProcessorConfig
from .errors import MediaError
from .image import PreprocessedImage
from .pil_pixels import exported_rgbx
from .video import PreprocessedVideo

DIGEST_SIZE = 32  # bytes (256 bits)
MEDIA_SCHEME = b"prism.media.v4"  # v4: image frames hashed as R, G, B, 0 (v3: R, G, B)
RAW_SCHEME = b"prism.raw.v3"
RGB_SCHEME = b"prism.rgb8.v3"
RGBX_SCHEME = b"prism.rgbx8.v1"

_U64 = struct.Struct("<Q")


class MediaHash(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def digest(self) -> bytes: ...


def new_hash() -> MediaHash:
    """The one hash of media identity (see the module docstring); its digest is `DIGEST_SIZE` bytes."""
    return blake3.blake3()


def hash_field(h: MediaHash, name: bytes, value: bytes | memoryview) -> None:
    h.update(_U64.pack(len(name)))
    h.update(name)
    h.update(_U64.pack(len(value)))
    h.update(value)


def _i64s(values: Sequence[int]) -> bytes:
    return np.asarray(list(values), dtype="<i8").tobytes()


def raw_digest(data: bytes | bytearray | memoryview) -> bytes:
    """Digest of the encoded file bytes (32 bytes)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MediaError(f"raw_digest needs bytes, got {type(data).__name__}")
    h = new_hash()
    hash_field(h, b"scheme", RAW_SCHEME)
    hash_field(h, b"bytes", memoryview(data).cast("B"))
    return h.digest()


def hash_rgb(h: MediaHash, arr: np.ndarray) -> None:
    """The shape and pixel fields of a uint8 image array (copied only if it is not contiguous)."""
    hash_field(h, b"shape", _i64s(arr.shape))
    hash_field(h, b"pixels", memoryview(np.ascontiguousarray(arr)).cast("B"))


def pixels_digest(image: Image.Image | np.ndarray) -> bytes:
    """Digest of an image given as pixels, an RGB PIL image or a uint8 [H, W, 3] array (32 bytes): the
    preprocessing cache's key for it (see the framing above)."""
    h = new_hash()
    rgbx = exported_rgbx(image) if isinstance(image, Image.Image) else None
    if rgbx is not None:
        hash_field(h, b"scheme", RGBX_SCHEME)
        hash_rgb(h, rgbx)
    else:
        hash_field(h, b"scheme", RGB_SCHEME)
        hash_rgb(h, np.asarray(image, dtype=np.uint8))
    return h.digest()


def _as_array(pixels: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(pixels, torch.Tensor):
        pixels = pixels.detach().to("cpu").contiguous().numpy()
    if not isinstance(pixels, np.ndarray):
        raise MediaError(f"pixels must be a tensor or an array, got {type(pixels).__name__}")
    # Explicit little-endian layout so the digest does not depend on the host byte order.
    return np.ascontiguousarray(pixels, dtype=pixels.dtype.newbyteorder("<"))


def media_digest(
    pixel_values: torch.Tensor | np.ndarray,
    grid_thw: Sequence[int],
    *,
    model_id: str,
    settings: str,
    kind: str,
    timestamps: Sequence[float] | None = None,
) -> bytes:
    """Digest of preprocessed media (32 bytes). `settings` is the processor fingerprint
    (`ImageProcessorConfig.fingerprint()` / `VideoProcessorConfig.fingerprint()`)."""
    if kind not in ("image", "video"):
        raise MediaError(f"kind must be 'image' or 'video', got {kind!r}")
    grid = [int(g) for g in grid_thw]
    if len(grid) != 3 or min(grid) <= 0:
        raise MediaError(f"grid_thw must be 3 positive ints, got {list(grid_thw)}")
    if kind == "video" and timestamps is None:
        raise MediaError("a video digest needs its per-temporal-patch timestamps")
    if kind == "image" and timestamps is not None:
        raise MediaError("an image digest takes no timestamps")
    arr = _as_array(pixel_values)
    h = new_hash()
    hash_field(h, b"scheme", MEDIA_SCHEME)
    hash_field(h, b"model_id", model_id.encode("utf-8"))
    hash_field(h, b"settings", settings.encode("utf-8"))
    hash_field(h, b"kind", kind.encode("ascii"))
    hash_field(h, b"grid", _i64s(grid))
    hash_field(h, b"dtype", arr.dtype.str.encode("ascii"))
    hash_field(h, b"shape", _i64s(arr.shape))
    if timestamps is not None:
        hash_field(h, b"timestamps", np.asarray(list(timestamps), dtype="<f8").tobytes())
    hash_field(h, b"pixels", memoryview(arr.reshape(-1).view(np.uint8)))
    return h.digest()


def image_digest(image: PreprocessedImage, *, model_id: str, config: ImageProcessorConfig) -> bytes:
    return media_digest(
        image.resized_rgb0, image.grid_thw, model_id=model_id, settings=config.fingerprint(), kind="image"
    )


def video_digest(video: PreprocessedVideo, *, model_id: str, config: VideoProcessorConfig) -> bytes:
    return media_digest(
        video.pixel_values_videos,
        video.grid_thw,
        model_id=model_id,
        settings=config.fingerprint(),
        kind="video",
        timestamps=video.timestamps,
    )
