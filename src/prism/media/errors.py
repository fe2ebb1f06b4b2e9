"""Typed errors of the media layer: every bad image, video or processor setting raises one of these.

All derive from `MediaError` (a `ValueError`), so the serving layer can map the whole family to a 4xx
response while tests and callers can still tell the cases apart.
"""

from __future__ import annotations


class MediaError(ValueError):
    """Base class of every media input / media configuration error."""


class MediaConfigError(MediaError):
    """A processor configuration (preprocessor_config.json) is missing keys, has unknown keys or bad values."""


class MediaDecodeError(MediaError):
    """The bytes are not a decodable image (unknown format, truncated or corrupt data)."""


class ImageTooLargeError(MediaError):
    """The media has more pixels (or bytes) than the configured limit allows."""


class DecompressionBombError(ImageTooLargeError):
    """The encoded header announces more pixels than the decode limit: refused before decoding any pixel."""


class ImagePixelBudgetError(ImageTooLargeError):
    """The images of one request announce more pixels in all than its budget (`max_image_pixels`), read from their
    headers: refused before any of them is decoded (`media.pixel_budget`)."""

    def __init__(self, message: str, *, total: int, limit: int, index: int) -> None:
        super().__init__(message)
        self.total = total  # the request's images' pixels in all
        self.limit = limit
        self.index = index  # the image (the request's images in order) whose pixels take the total past it


class VideoPixelBudgetError(ImagePixelBudgetError):
    """The frames a request's videos sample announce more pixels in all than its video budget (`max_video_pixels`):
    refused before any of them is decoded (`media.pixel_budget`). `index` is the video, `frame` its frame (an index
    into the frames it was given) whose pixels take the total past the limit."""

    def __init__(self, message: str, *, total: int, limit: int, index: int, frame: int) -> None:
        super().__init__(message, total=total, limit=limit, index=index)
        self.frame = frame


class ImageTooSmallError(MediaError):
    """The image (or a video frame) is empty, below the minimum side, or would resize to an empty grid."""


class AspectRatioError(MediaError):
    """The long side is more than the allowed multiple (200, as in Qwen's smart_resize) of the short side."""


class VideoError(MediaError):
    """The video input is malformed: no frames, mixed frame sizes, bad fps or too few sampled frames."""


class PlaceholderError(MediaError):
    """Placeholder tokens in a prompt do not match the media items supplied with it."""
