"""Qwen image preprocessing without torchvision or transformers: decode -> smart resize -> rescale ->
normalize -> patchify.

Owns: the pixel layout the vision encoder consumes. It reproduces HF transformers 5.17's
`Qwen2VLImageProcessorPil` (the processor Qwen3-VL uses, with the checkpoint's settings) exactly:
- `smart_resize`: both sides multiples of factor = patch_size * merge_size, area within [min, max] pixels,
  aspect ratio kept; long/short side > 200 is an error. Same float arithmetic as HF (Python round, floor, ceil).
- resize with PIL bicubic (HF's PIL backend converts to a PIL image and calls `Image.resize`).
- rescale in float64 then cast to float32, normalize in float32 (HF's `rescale` / `normalize` order), so the
  values are bit-identical to HF's for the same resized pixels.
- patchify to `pixel_values [gh*gw, C*T*p*p]` in HF's order (merge-window major: gh/m, gw/m, m, m; then
  C, T, p, p), the single image repeated T (= temporal_patch_size) times; grid_thw = (1, gh, gw).
  The image stays its resized uint8 frame (`media.pixels.PatchPixels`), patchified and normalized by the
  256-level table of the formula above where it is encoded: the same values, a sixth of the bytes until then.
  The frame is R, G, B and a zero byte per pixel (`pil_pixels.rgb0_frame`): Pillow's own layout, so it leaves
  Pillow in one copy without the GIL.

Decoding from bytes refuses oversized images from the header alone (before any pixel is decoded), maps every
PIL failure to a typed error, applies the EXIF orientation and converts to RGB (what HF's `load_image` does).
`header_size` makes the checks before decoding alone and returns the size the header announces (a request's pixel
budget sums those, `media.pixel_budget`).
Bytes are decoded only in the formats of `ACCEPTED_FORMATS`, by Pillow's own decoders: Pillow opens many more,
and its EPS plugin decodes by running Ghostscript (`gs` from PATH) on the bytes, a program interpreting a
client's PostScript on the server. Anything else is a `MediaDecodeError` naming the accepted formats.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .config import ImageProcessorConfig
from .errors import (
    AspectRatioError,
    DecompressionBombError,
    ImageTooLargeError,
    ImageTooSmallError,
    MediaDecodeError,
    MediaError,
)
from .pil_pixels import rgb0_frame
from .pixels import PatchPixels

MAX_ASPECT_RATIO = 200  # Qwen's smart_resize limit on long side / short side

# The picture formats clients send (MPO, a phone's JPEG with a second picture, opens as JPEG), all decoded inside
# Pillow, each opened from its header alone (the size limits judge an image before its pixels are decoded). Not every
# format Pillow opens: EPS runs Ghostscript, ICO decodes its whole picture as it opens (a 258 KB icon wrapping a flat
# 9000x9000 PNG cost 1 s and 534 MB before any limit saw its size), and its rarer decoders are parsers no client needs.
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF", "JPEG2000", "PPM", "TGA", "QOI")


@functools.cache
def decoded_formats() -> tuple[str, ...]:
    """`ACCEPTED_FORMATS` this Pillow has decoders for (`Image.open` fails on a format name it does not know)."""
    Image.init()
    return tuple(f for f in ACCEPTED_FORMATS if f in Image.OPEN)


@dataclass(frozen=True)
class DecodeLimits:
    """Limits applied before / while decoding. max_pixels defaults to PIL's default
    `Image.MAX_IMAGE_PIXELS` value (89,478,485), kept here as our own number so a global change to PIL
    does not change our policy."""

    max_pixels: int = 89_478_485
    max_bytes: int = 64 * 1024 * 1024
    min_side: int = 1

    def check_size(self, width: int, height: int, what: str = "image") -> None:
        if width < self.min_side or height < self.min_side:
            raise ImageTooSmallError(f"{what} is {width}x{height}; each side must be >= {self.min_side}")
        if width * height > self.max_pixels:
            raise ImageTooLargeError(
                f"{what} is {width}x{height} = {width * height} pixels; the limit is {self.max_pixels}"
            )


DEFAULT_LIMITS = DecodeLimits()


@dataclass(frozen=True)
class PreprocessedImage:
    """One image ready for the vision encoder."""

    pixels: PatchPixels  # the resized frame, patchified and normalized where it is encoded
    # uint8 [H, W, 4] after smart resize, R, G, B and a zero byte per pixel (`pixels.frame`'s storage):
    # pixel_values is a one-to-one function of these and the processor settings (normalization is injective per
    # channel), so the content digest hashes these 6x fewer bytes.
    resized_rgb0: np.ndarray
    grid_thw: tuple[int, int, int]  # (1, gh, gw) in patches
    image_size: tuple[int, int]  # (height, width) before resize
    resized_size: tuple[int, int]  # (height, width) after smart resize

    @property
    def pixel_values(self) -> torch.Tensor:
        """float32 [gh*gw, C*T*p*p], normalized as HF does (computed on each access)."""
        return self.pixels.normalized()

    def num_tokens(self, merge_size: int) -> int:
        """LM placeholder tokens for this image: t*h*w / merge^2."""
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)


def fit_to_pixel_budget(
    height: int,
    width: int,
    *,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    frames: int = 1,
    rounded_frames: int = 1,
) -> tuple[int, int]:
    """The core of Qwen's smart resize, shared by images and videos: refuse extreme aspect ratios,
    round both sides to `factor`, then rescale so that `rounded_frames` frames of that size fit the
    pixel budget (the rescale factor uses the unrounded `frames`, as Qwen does)."""
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise AspectRatioError(f"absolute aspect ratio must be at most {MAX_ASPECT_RATIO}, got {ratio}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if rounded_frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif rounded_frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area in [min_pixels, max_pixels], aspect kept."""
    if height <= 0 or width <= 0:
        raise ImageTooSmallError(f"image is {width}x{height}; both sides must be positive")
    h_bar, w_bar = fit_to_pixel_budget(
        height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels
    )
    if h_bar <= 0 or w_bar <= 0:  # only reachable with min_pixels == 0 and a side below factor / 2
        raise ImageTooSmallError(f"image {width}x{height} resizes to an empty {w_bar}x{h_bar} grid")
    return h_bar, w_bar


def target_size(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int]:
    """The (height, width) an image is resized to: smart resize under the processor's settings; where that makes
    more than `config.step_tokens` LM tokens, smart resize again with max_pixels at that budget, then whole factors
    off the longer side while it is still above it (so an image that fits is resized exactly as the checkpoint's
    settings resize it, and one that does not fits)."""
    h, w = smart_resize(height, width, factor=config.factor, min_pixels=config.min_pixels,
                        max_pixels=config.max_pixels)
    budget = None if config.step_tokens is None else config.step_tokens * config.factor**2
    if budget is not None and h * w > budget:
        h, w = smart_resize(height, width, factor=config.factor, min_pixels=min(config.min_pixels, budget),
                            max_pixels=budget)
        # smart resize rounds each side to the factor and keeps at least one factor a side: at a small budget
        # (a 64x64 image at 50 tokens) or an extreme aspect it can still land above it. Take whole factors off the
        # longer side until it fits.
        f = config.factor
        rows, cols = h // f, w // f
        while rows * cols > config.step_tokens and max(rows, cols) > 1:
            if rows >= cols:
                rows -= 1
            else:
                cols -= 1
        h, w = rows * f, cols * f
    return h, w


def header_size(data: bytes | bytearray | memoryview, limits: DecodeLimits = DEFAULT_LIMITS) -> tuple[int, int]:
    """(width, height) that encoded image bytes announce, read from their header under the checks `decode_image` makes
    before it decodes (bytes, format, pixels; the same errors): no pixel is decoded. The EXIF orientation may swap
    the sides, never their product."""
    with _opened(data, limits) as img:
        return img.size


def _opened(data: bytes | bytearray | memoryview, limits: DecodeLimits) -> Image.Image:
    """The image the bytes hold, opened (its header read, nothing decoded) and within `limits`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MediaDecodeError(f"image data must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise MediaDecodeError("image data is empty")
    if len(data) > limits.max_bytes:
        raise ImageTooLargeError(f"encoded image is {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        # No warnings.catch_warnings() here: it mutates process-global state and decoding runs on a
        # worker pool. PIL's own bomb check (warning / error at 2x its global limit) may add to ours.
        img = Image.open(io.BytesIO(bytes(data)), formats=decoded_formats())
    except Image.DecompressionBombError as exc:
        raise DecompressionBombError(f"image header announces too many pixels: {exc}") from exc
    except UnidentifiedImageError as exc:  # PIL's message names its BytesIO object: nothing for the client
        raise MediaDecodeError(
            f"bytes are not a decodable image (no image format recognised; accepted: {', '.join(decoded_formats())})"
        ) from exc
    except Exception as exc:  # untrusted bytes: any parser failure is a decode error, not a crash
        raise MediaDecodeError(f"bytes are not a decodable image: {type(exc).__name__}: {exc}") from exc
    width, height = img.size  # read from the header; nothing decoded yet
    if width * height > limits.max_pixels:
        img.close()
        raise DecompressionBombError(
            f"image header announces {width}x{height} = {width * height} pixels; the limit is "
            f"{limits.max_pixels} (refused before decoding)"
        )
    return img


def decode_image(data: bytes | bytearray | memoryview, limits: DecodeLimits = DEFAULT_LIMITS) -> Image.Image:
    """Decode encoded image bytes to an RGB PIL image, refusing decompression bombs from the header."""
    img = _opened(data, limits)
    try:
        img.load()
        img = ImageOps.exif_transpose(img)
        img = img.convert("RGB")
    except Image.DecompressionBombError as exc:
        raise DecompressionBombError(f"image decodes to too many pixels: {exc}") from exc
    except Exception as exc:  # truncated data, corrupt EXIF, codec errors
        raise MediaDecodeError(f"image data is truncated or corrupt: {type(exc).__name__}: {exc}") from exc
    limits.check_size(*img.size)
    return img


def to_rgb_image(
    image: Image.Image | np.ndarray, limits: DecodeLimits = DEFAULT_LIMITS, what: str = "image"
) -> Image.Image:
    """An RGB PIL image from encoded bytes (decoded under `limits`), a PIL image (any mode) or a uint8 [H, W, 3]
    array; size limits checked."""
    if isinstance(image, (bytes, bytearray, memoryview)):  # (a video's frames given as PNG / JPEG files)
        return decode_image(image, limits)
    if isinstance(image, Image.Image):
        limits.check_size(*image.size, what=what)
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, np.ndarray):
        return Image.fromarray(np.ascontiguousarray(checked_rgb_array(image, limits, what)), mode="RGB")
    raise MediaError(f"{what} must be bytes, a PIL image or a uint8 array, got {type(image).__name__}")


def checked_rgb_array(image: np.ndarray, limits: DecodeLimits = DEFAULT_LIMITS, what: str = "image") -> np.ndarray:
    """`image` itself once it is a uint8 [H, W, 3] array within the size limits."""
    if not _is_rgb_array(image):
        raise MediaError(f"{what} array must be uint8 [H, W, 3], got {image.dtype} {list(image.shape)}")
    limits.check_size(image.shape[1], image.shape[0], what=what)
    return image


def _is_rgb_array(image: object) -> bool:
    return isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3


def resized_pil(image: Image.Image, height: int, width: int) -> Image.Image:
    """PIL bicubic resize, as HF's PIL backend does it: `Image.resize((w, h), BICUBIC)`."""
    return image.resize((width, height), resample=Image.Resampling.BICUBIC)


def resize_rgb(image: Image.Image, height: int, width: int) -> np.ndarray:
    """`resized_pil` -> uint8 [H, W, 3], writable."""
    return np.array(resized_pil(image, height, width), dtype=np.uint8)


@functools.lru_cache(maxsize=16)
def normalize_table_tensor(mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float) -> torch.Tensor:
    """`_normalize_table` as a (shared, read-only by convention) float32 tensor [C, 256]."""
    return torch.tensor(_normalize_table(tuple(mean), tuple(std), float(rescale_factor)))


@functools.lru_cache(maxsize=16)
def _normalize_table(mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float) -> np.ndarray:
    """float32 [C, 256]: the normalized value of every uint8 level per channel, computed by HF's formula."""
    levels = np.arange(256, dtype=np.uint8)[:, None].repeat(len(mean), axis=1)  # [256, C]
    x = (levels.astype(np.float64) * rescale_factor).astype(np.float32)
    table = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    table.setflags(write=False)
    return np.ascontiguousarray(table.T)


def normalize(
    frames_u8: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float
) -> np.ndarray:
    """uint8 [..., C] -> float32 [..., C]: x * rescale (float64, then float32), then (x - mean) / std in float32,
    the exact operation order of HF's numpy `rescale` and `normalize`. Done as a lookup in the 256-level table
    of that formula: element-wise arithmetic, so bitwise the same values, without float64 temporaries."""
    table = _normalize_table(tuple(mean), tuple(std), float(rescale_factor))
    return table[np.arange(table.shape[0]), frames_u8]


def patchify(
    frames: np.ndarray, *, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """frames [F, H, W, C] (F a multiple of temporal_patch_size) -> (pixel_values [gt*gh*gw, C*T*p*p], (gt, gh, gw)).

    Row order: gt, gh/m, gw/m, m, m (a merge window's m*m patches are consecutive); column order C, T, p, p.
    """
    n_frames, height, width, channels = frames.shape
    t, p, m = temporal_patch_size, patch_size, merge_size
    if n_frames % t or height % (p * m) or width % (p * m):
        raise MediaError(f"cannot patchify {list(frames.shape)} with temporal {t}, patch {p}, merge {m}")
    gt, gh, gw = n_frames // t, height // p, width // p
    x = frames.reshape(gt, t, gh // m, m, p, gw // m, m, p, channels)
    # -> (gt, gh/m, gw/m, mh, mw, C, T, ph, pw)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, channels * t * p * p), (gt, gh, gw)


def preprocess_image(
    image: bytes | bytearray | memoryview | Image.Image | np.ndarray,
    config: ImageProcessorConfig,
    limits: DecodeLimits = DEFAULT_LIMITS,
) -> PreprocessedImage:
    """Encoded bytes, a PIL image or a uint8 [H, W, 3] array -> pixel_values and grid_thw for the encoder."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        rgb = decode_image(image, limits)
    else:
        rgb = to_rgb_image(image, limits) if not _is_rgb_array(image) else image
    height, width = (rgb.shape[0], rgb.shape[1]) if isinstance(rgb, np.ndarray) else (rgb.size[1], rgb.size[0])
    if isinstance(rgb, np.ndarray):
        limits.check_size(width, height)
    new_h, new_w = target_size(height, width, config)
    if (new_h, new_w) == (height, width):
        # PIL's resize to the same size returns a copy of the image: the pixels as they are, copied once (the
        # cache keeps them: never a view of the caller's pixels).
        resized = rgb0_frame(rgb)
    else:
        pil = rgb if isinstance(rgb, Image.Image) else Image.fromarray(rgb, mode="RGB")
        resized = rgb0_frame(resized_pil(pil, new_h, new_w))
    table = normalize_table_tensor(tuple(config.image_mean), tuple(config.image_std), float(config.rescale_factor))
    # The frame is patchified (repeated over the temporal patch) and normalized where it is encoded (`PatchPixels`).
    p = config.patch_size
    frame = torch.from_numpy(resized)
    resized.flags.writeable = False  # shared through the cache under its digest
    return PreprocessedImage(
        pixels=PatchPixels(frame, table, p, config.merge_size, config.temporal_patch_size),
        resized_rgb0=resized,
        grid_thw=(1, new_h // p, new_w // p),
        image_size=(height, width),
        resized_size=(new_h, new_w),
    )
