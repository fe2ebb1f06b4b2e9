"""A chat request's videos at the server (`{"type": "video", "video": {"frames": [image URLs], "fps": ...}}`): refused
on what can be known without decoding a frame before any frame is decoded, and handed to the engine encoded, so that
only the frames the engine samples are ever decoded.

Owns:
- a video's sampling (`media.video.sample_video` under the engine's video processor settings, the one rule the engine
  samples by) is settled from its frame count and rate before any of its frames is fetched: a video the engine would
  refuse for them (a rate whose timestamps a float no longer tells apart, fewer sampled frames than a temporal patch)
  is a 400 that costs no fetch and no decode;
- once every media source of the request is read, every frame sent is judged from its header: an image of an
  accepted format (else a 400) within one frame's limit (`DecodeLimits.max_pixels`, a 413), sampled or not;
- `max_video_pixels` counts the frames the request's videos sample (a 413 that says so): the frames that are decoded,
  as the engine counts them (`media.pixel_budget`, `MediaPreparer.plan_videos`), so the server and the engine give a
  request the same verdict, not the frames sent (a 30 fps video of 256 frames samples 17 at Qwen3-VL's 2 fps);
- the frames go to the engine as their encoded bytes (`prepare_chat` takes encoded frames): the engine samples the
  video by the same rule and decodes each sampled frame once (`media.video.decode_sampled_frames`), none of the
  others. A sampled frame whose header was fine and whose body does not decode is the engine's 400, after this
  resolver accepted the request (its data URLs stay cached, as an image's would).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..media.config import VideoProcessorConfig
from ..media.errors import (
    DecompressionBombError,
    ImageTooLargeError,
    MediaError,
    VideoError,
    VideoPixelBudgetError,
)
from ..media.image import DecodeLimits, header_size
from ..media.pixel_budget import check_video_pixels, sampled_frame_sizes
from ..media.video import VideoSampling, sample_video
from .media_url_errors import InvalidMediaData, InvalidVideo, MediaTooLarge
from .protocol import VideoPart


@dataclass
class SentVideo:
    """One video of a request: its resolved message part, the frames it samples (`check_sampling`) and each frame's
    bytes with the request's field for it."""

    part: dict[str, Any]
    sampling: VideoSampling
    frames: list[tuple[bytes, str]] = field(default_factory=list)


def check_sampling(part: VideoPart, where: str, config: VideoProcessorConfig) -> VideoSampling:
    """The frames the engine samples of this video, or `InvalidVideo` for a frame count and rate its sampling
    refuses."""
    try:
        return sample_video(len(part.video.frames), part.video.fps, config)
    except VideoError as exc:
        raise InvalidVideo(str(exc), param=f"{where}.video") from exc


def _frame_limit_error(exc: ImageTooLargeError, limits: DecodeLimits, param: str) -> MediaTooLarge:
    if isinstance(exc, DecompressionBombError):
        return MediaTooLarge(f"a video frame may have at most {limits.max_pixels} pixels ({exc})", param=param)
    return MediaTooLarge(str(exc), param=param)


def check_frame_pixels(videos: Sequence[SentVideo], max_video_pixels: int, max_bytes: int, whose_limit: str = ""
                       ) -> None:
    """Each frame's header an image within one frame's limits, and the frames the videos sample within
    `max_video_pixels` in all (a 413 naming the limit crossed, `whose_limit` said after the budget's): nothing
    decoded."""
    limits = DecodeLimits(max_bytes=max_bytes)
    sampled = []
    for video in videos:
        sizes = []
        for data, param in video.frames:
            try:
                sizes.append(header_size(data, limits))
            except ImageTooLargeError as exc:
                raise _frame_limit_error(exc, limits, param) from exc
            except MediaError as exc:
                raise InvalidMediaData(f"video frame is not a decodable image: {exc}", param=param) from exc
        sampled.append(sampled_frame_sizes(video.sampling.indices.tolist(), sizes.__getitem__))
    try:
        check_video_pixels(sampled, max_video_pixels)
    except VideoPixelBudgetError as exc:
        raise MediaTooLarge(f"{exc}{whose_limit}", param=videos[exc.index].frames[exc.frame][1]) from exc
