"""Owns the per-request budgets of image and video-frame pixels: the images of one request decode to at most
`max_image_pixels` pixels in all, judged from what each announces (an encoded image's header, a decoded one's size)
before any of them is decoded, so that a few hundred KB of flat-colour PNG cannot cost GBs of memory and seconds of
CPU per image (each image alone is bounded by `DecodeLimits.max_pixels`, ~89 M pixels, but a request may carry many).

Every image a request carries pixels for counts, whether or not a cache already holds its preprocessing: the verdict
depends on the request alone, never on what other requests sent before. An image named by its uuid alone carries no
pixels and costs no decoding (the one it names was counted when it was sent): it does not count.

The default, 2**28 = 268,435,456 pixels, is 16 images (the server's `max_media_per_request`) at 4096 x 4096, the most
Qwen3-VL's processor keeps of an image (its `longest_edge`, 16,777,216 pixels; larger images are downscaled): no
request that Qwen3-VL would compute at full resolution is refused. The server and the engine each check it (the
server's `ServerSettings.max_image_pixels` in its media resolver, the engine's `EngineConfig.max_image_pixels` when a
prompt is prepared); the refusal is an `ImagePixelBudgetError`, an `ImageTooLargeError`: a 413 over HTTP.

Video frames have a budget of their own, `max_video_pixels` (2**27 by default: 64 frames of 1920 x 1080): the frames
a request's videos sample (`media.video.sample_video`: those that are decoded and resized; a frame sampled twice counts
twice), width x height each, summed over all of its videos, judged from what each frame announces before any is
decoded. The server and the engine count alike (`serving.video_frames` reads every frame's header, counts the sampled
ones and hands the frames over encoded; the engine decodes only those), so a video sent whole costs what its sampled
frames cost, and the frames sent but not sampled cost a header read each (bounded by the server's frame count and
byte limits). The server's resolver refuses at the lower of its own and the engine's limits, so that it refuses first.
The refusal is a `VideoPixelBudgetError`, an `ImagePixelBudgetError` (a 413 over HTTP), whose message says it counts
the frames the videos sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .errors import ImagePixelBudgetError, VideoPixelBudgetError

DEFAULT_MAX_IMAGE_PIXELS = 2**28
DEFAULT_MAX_VIDEO_PIXELS = 2**27


def _crossing(sizes: Sequence[tuple[int, int] | None], limit: int) -> tuple[int, int | None]:
    """The sizes' pixels in all, and the position of the one that takes them past `limit` (None: within it)."""
    running, crossing = 0, None
    for index, size in enumerate(sizes):
        if size is not None:
            running += size[0] * size[1]
            if running > limit and crossing is None:
                crossing = index
    return running, crossing


def check_image_pixels(sizes: Sequence[tuple[int, int] | None], limit: int) -> None:
    """`ImagePixelBudgetError` naming the limit, the total and the image that crosses it when the (width, height)
    sizes of a request's images, in order, sum to more than `limit` pixels (None: an image that carries no pixels)."""
    running, index = _crossing(sizes, limit)
    if index is None:
        return
    w, h = sizes[index]  # type: ignore[misc]
    raise ImagePixelBudgetError(
        f"the images of this request announce {running} pixels in all; the limit is max_image_pixels={limit}, "
        f"crossed at image {index} ({w}x{h}): refused before decoding any",
        total=running, limit=limit, index=index,
    )


def sampled_frame_sizes(indices: Sequence[int], size_of: Callable[[int], tuple[int, int]]
                        ) -> list[tuple[int, int, int]]:
    """(index, width, height) of each sampled frame, in sampling order, for `check_video_pixels`: `size_of(i)`, what
    frame i announces, asked once per frame however often it is sampled."""
    sizes: dict[int, tuple[int, int]] = {}
    for i in indices:
        if i not in sizes:
            sizes[i] = size_of(i)
    return [(i, *sizes[i]) for i in indices]


def check_video_pixels(videos: Sequence[Sequence[tuple[int, int, int]]], limit: int) -> None:
    """`VideoPixelBudgetError` naming the limit, the total and the frame that crosses it when the frames a request's
    videos sample, in order, each (its index among the frames given, width, height), sum to more than `limit`."""
    flat = [(video, frame, w, h) for video, frames in enumerate(videos) for frame, w, h in frames]
    running, crossing = _crossing([(w, h) for _, _, w, h in flat], limit)
    if crossing is None:
        return
    video, frame, w, h = flat[crossing]
    raise VideoPixelBudgetError(
        f"the frames this request's videos sample announce {running} pixels in all; the limit is "
        f"max_video_pixels={limit}, crossed at video {video}'s frame {frame} ({w}x{h}): refused before decoding any",
        total=running, limit=limit, index=video, frame=frame,
    )
