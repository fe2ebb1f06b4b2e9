"""A chat request's videos at the server (`{"type": "video", "video": {"frames": [image URLs], "fps": ...}}`): refused
on what can be known without decoding a frame before any frame is decoded.

Owns:
- a video's sampling (`media.video.sample_video` under the engine's video processor settings) is settled from its
  frame count and rate before any of its frames is fetched: a video the engine would refuse for them (a rate whose
  timestamps a float no longer tells apart, fewer sampled frames than a temporal patch) is a 400 that costs no fetch
  and no decode;
- the frames of all of a request's videos are judged from their headers (each within one frame's limit,
  `DecodeLimits.max_pixels`; all the frames sent within `max_video_pixels`, `media.pixel_budget`) once every media
  source of the request is read, and decoded only then, each once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from ..media.config import VideoProcessorConfig
from ..media.errors import (
    DecompressionBombError,
    ImageTooLargeError,
    MediaError,
    VideoError,
    VideoPixelBudgetError,
)
from ..media.image import DecodeLimits, decode_image, header_size
from ..media.pixel_budget import check_video_pixels
from ..media.video import sample_video
from .media_url_errors import InvalidMediaData, InvalidVideo, MediaTooLarge
from .protocol import VideoPart


@dataclass
class SentVideo:
    """One video of a request: its resolved message part (its `"video"` filled by `decode_frames`) and each frame's
    bytes with the request's field for it."""

    part: dict[str, Any]
    frames: list[tuple[bytes, str]] = field(default_factory=list)


def check_sampling(part: VideoPart, where: str, config: VideoProcessorConfig) -> None:
    """`InvalidVideo` for a video whose frame count and rate the engine's sampling refuses."""
    try:
        sample_video(len(part.video.frames), part.video.fps, config)
    except VideoError as exc:
        raise InvalidVideo(str(exc), param=f"{where}.video") from exc


def _frame_limit_error(exc: ImageTooLargeError, limits: DecodeLimits, param: str) -> MediaTooLarge:
    if isinstance(exc, DecompressionBombError):
        return MediaTooLarge(f"a video frame may have at most {limits.max_pixels} pixels ({exc})", param=param)
    return MediaTooLarge(str(exc), param=param)


def check_frame_pixels(videos: Sequence[SentVideo], max_video_pixels: int, max_bytes: int, whose_limit: str = ""
                       ) -> None:
    """Each frame's header within one frame's limits, and the frames sent within `max_video_pixels` in all (a 413
    naming the limit crossed, `whose_limit` said after the budget's): nothing decoded."""
    limits = DecodeLimits(max_bytes=max_bytes)
    sizes = []
    for video in videos:
        announced = []
        for k, (data, param) in enumerate(video.frames):
            try:
                announced.append((k, *header_size(data, limits)))
            except ImageTooLargeError as exc:
                raise _frame_limit_error(exc, limits, param) from exc
            except MediaError as exc:
                raise InvalidMediaData(f"video frame is not a decodable image: {exc}", param=param) from exc
        sizes.append(announced)
    try:
        check_video_pixels(sizes, max_video_pixels, counted="the video frames this request sends")
    except VideoPixelBudgetError as exc:
        raise MediaTooLarge(f"{exc}{whose_limit}", param=videos[exc.index].frames[exc.frame][1]) from exc


def decode_frames(videos: Sequence[SentVideo], max_bytes: int) -> None:
    """Each video's frames decoded into its part (`prepare_chat` takes decoded frames), once `check_frame_pixels` has
    judged them."""
    limits = DecodeLimits(max_bytes=max_bytes)
    for video in videos:
        frames: list[Image.Image] = []
        for data, param in video.frames:
            try:
                frames.append(decode_image(data, limits))
            except ImageTooLargeError as exc:
                raise _frame_limit_error(exc, limits, param) from exc
            except MediaError as exc:
                raise InvalidMediaData(f"video frame is not a decodable image: {exc}", param=param) from exc
        video.part["video"] = frames
