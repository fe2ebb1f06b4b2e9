"""Qwen3-VL video preprocessing from decoded frames: frame sampling, per-video smart resize, patchify and
the per-temporal-patch timestamps that Qwen3-VL renders as text.

Owns: the video pixel layout and the timestamps, following HF transformers 5.17
(`Qwen3VLVideoProcessor`, `Qwen3VLProcessor._calculate_timestamps`):
- sampling: n = int(total / video_fps * fps) clamped to [min_frames, max_frames] and to total; with an
  explicit frame count, n is used as is (HF's rule) up to the processor's own `max_frames` (the most frames it samples
  a video to at any fps; more is a `VideoError`, where HF would sample any count, a huge one filling the memory);
  indices = round(linspace(0, total - 1, n)). A video_fps so small that total / video_fps * fps leaves the floats
  is a `VideoError` (HF's int() of it fails). Every rate is checked by `media.rates` (a request's as a checkpoint's):
  a positive finite number, a sampling rate at most `MAX_SAMPLING_FPS`, so that only a video whose timestamps would
  not fit can leave the floats.
- smart resize of the Qwen3-VL video variant: min/max pixels bound the TOTAL over the sampled frames
  (t_bar * h * w), frames smaller than factor are first scaled up; fewer sampled frames than the temporal
  patch is an error. Optional per-frame cap (`cap_pixels_per_frame`, qwen-vl-utils behaviour).
- an odd frame count is padded by repeating the last frame (HF's patchify), and so are the indices the
  timestamps are computed from; each timestamp is the mean of the first and last frame time of its group
  and is rendered as `<{t:.1f} seconds>`, as HF renders it. A timestamp of `MAX_TIMESTAMP_SECONDS` (2**49 s, 17.8
  million years) or more is a `VideoError`: from there a float64 no longer tells tenths of a second apart, so the
  text's digits are the float's artefacts (a video_fps of 1e-300 made 300-digit timestamps, HF's too); below it
  the timestamps are HF's, so no frame rate a real video has (or a time-lapse's, at a frame a year) is refused.
- the sampling and the timestamps are settled (`sample_video`) before any frame is decoded, and so is every refusal
  they decide (the rates and counts above, fewer sampled frames than a temporal patch); the frames sampled are then
  decoded once each (`preprocess_sampled_frames` takes them decoded).
- pixel rows in the same order as images (see image.patchify); grid_thw = (frames / T, gh, gw).

Two known differences: HF resizes video frames with torchvision (bicubic, antialias, on tensors); torchvision
does not install beside CPU torch here, so frames are resized with PIL bicubic like images. Grids, sampling,
timestamps and the patch layout are exact; resized pixel values can differ from HF's by a rounding step. And HF
normalizes video pixels in one fused fp32 step ((x - 127.5) / 127.5 for Qwen's mean and std) where frames here take
the images' table (rescaled in fp64, rounded, then normalized): half the 256 levels differ by one fp32 ulp (at most
5.9e-8), identical once cast to bf16 or fp16 (session 27's review).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from .config import VideoProcessorConfig
from .errors import ImageTooSmallError, MediaDecodeError, VideoError
from .image import (
    DEFAULT_LIMITS,
    DecodeLimits,
    fit_to_pixel_budget,
    normalize,
    patchify,
    resize_rgb,
    to_rgb_image,
)
from .rates import MAX_TIMESTAMP_SECONDS, checked_rate, checked_sampling_rate

Frame = Image.Image | np.ndarray


@dataclass(frozen=True)
class PreprocessedVideo:
    """One video ready for the vision encoder, plus what the prompt needs (timestamps per temporal patch)."""

    pixel_values_videos: torch.Tensor  # [gt*gh*gw, C*T*p*p] float32
    grid_thw: tuple[int, int, int]  # (gt, gh, gw) in patches
    frame_indices: tuple[int, ...]  # source frame indices that were sampled (before temporal padding)
    timestamps: tuple[float, ...]  # seconds, one per temporal patch (len == gt)
    video_fps: float
    resized_size: tuple[int, int]

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)

    def timestamp_texts(self) -> list[str]:
        return [timestamp_text(t) for t in self.timestamps]


def timestamp_text(seconds: float) -> str:
    """The text Qwen3-VL's processor puts before each temporal patch of a video."""
    return f"<{float(seconds):.1f} seconds>"


def video_smart_resize(
    num_frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Qwen3-VL's video smart resize: (height, width) for every frame of a `num_frames`-frame clip."""
    if num_frames < temporal_factor:
        raise VideoError(f"video has {num_frames} sampled frames; at least {temporal_factor} are needed")
    if height <= 0 or width <= 0:
        raise ImageTooSmallError(f"video frames are {width}x{height}; both sides must be positive")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if min(height, width) <= 0:
        raise ImageTooSmallError(f"video frames of {width}x{height} cannot be scaled to the patch grid")
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    return fit_to_pixel_budget(
        height,
        width,
        factor=factor,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        frames=num_frames,
        rounded_frames=t_bar,
    )


def effective_max_pixels(num_frames: int, config: VideoProcessorConfig) -> int:
    """The total pixel budget for smart resize, with the optional per-frame cap of qwen-vl-utils."""
    if not config.cap_pixels_per_frame:
        return config.max_pixels
    frame_cap = config.max_video_tokens * config.factor * config.factor
    per_frame = max(min(frame_cap, config.max_pixels // num_frames), int(config.min_pixels * 1.05))
    return per_frame * num_frames


def _check_fps(value: float | None, name: str) -> float:
    return checked_rate(value, name, VideoError)


def _frames_at_fps(total_frames: int, video_fps: float, fps: float, config: VideoProcessorConfig) -> int:
    """HF's frame count for sampling at `fps`: int(total / video_fps * fps) clamped to [min_frames, max_frames] and
    to total; a VideoError where that product is not a float (int() of it would be an OverflowError)."""
    wanted = total_frames / video_fps * fps
    if not math.isfinite(wanted):
        raise VideoError(f"video_fps={video_fps!r} is too small: {total_frames} frames at that rate last longer "
                         "than a float holds")
    return min(max(int(wanted), config.min_frames), config.max_frames, total_frames)


def sample_frame_indices(
    total_frames: int,
    video_fps: float,
    config: VideoProcessorConfig,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
) -> np.ndarray:
    """Uniform frame indices (int64). `fps` / `num_frames` override the config (passing both is an error);
    a frame count wins over the config's fps, as in HF; a `num_frames` past the config's `max_frames` is refused."""
    if total_frames <= 0:
        raise VideoError("video has no frames")
    if fps is not None and num_frames is not None:
        raise VideoError("fps and num_frames are mutually exclusive")
    if fps is None and num_frames is None:
        num_frames = config.num_frames
        fps = config.fps if num_frames is None else None
    if num_frames is None and fps is not None:
        n = _frames_at_fps(total_frames, _check_fps(video_fps, "video_fps"),
                           checked_sampling_rate(fps, "target fps", VideoError), config)
    elif num_frames is None:
        n = min(max(total_frames, config.min_frames), config.max_frames)
    else:
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames <= 0:
            raise VideoError(f"num_frames must be a positive int, got {num_frames!r}")
        if num_frames > config.max_frames:
            raise VideoError(f"num_frames={num_frames} is more frames than this model's video processor samples a "
                             f"video to (its max_frames={config.max_frames})")
        n = num_frames
    return np.linspace(0, total_frames - 1, n).round().astype(np.int64)


def frame_group_timestamps(
    frame_indices: Sequence[int] | np.ndarray, video_fps: float, temporal_patch_size: int
) -> list[float]:
    """Seconds per temporal patch: indices padded with the last one to a multiple of T, then the mean of
    the first and last frame time inside each group (float64, HF's arithmetic order)."""
    idx = np.asarray(frame_indices, dtype=np.int64)
    if idx.ndim != 1 or idx.size == 0:
        raise VideoError("frame_indices must be a non-empty 1-D sequence")
    fps = _check_fps(video_fps, "video_fps")
    if pad := -idx.size % temporal_patch_size:
        idx = np.concatenate([idx, np.full(pad, idx[-1], dtype=np.int64)])
    with np.errstate(over="ignore"):  # a time past the floats is refused below, not warned about
        groups = (idx.astype(np.float64) / fps).reshape(-1, temporal_patch_size)
        stamps = (groups[:, 0] + groups[:, -1]) / 2
    if not np.isfinite(stamps).all():
        raise VideoError(f"video_fps={video_fps!r} is too small: frame {int(idx.max())} at that rate lies later than a "
                         "float holds")
    if (latest := float(stamps.max())) >= MAX_TIMESTAMP_SECONDS:
        raise VideoError(
            f"video fps={video_fps!r} is too small: its last timestamp would be {latest:.3g} seconds, and the "
            "'<t seconds>' timestamps the model reads must stay below 2**49 seconds (17.8 million years), where a "
            "float still tells tenths of a second apart (give the rate the frames were taken at)"
        )
    return stamps.tolist()


def _frame_list(frames: Sequence[Frame] | np.ndarray) -> list[Frame]:
    if isinstance(frames, np.ndarray):
        if frames.ndim != 4:
            raise VideoError(f"a video array must be uint8 [F, H, W, 3], got shape {list(frames.shape)}")
        return list(frames)
    if not isinstance(frames, Sequence) or isinstance(frames, (str, bytes)):
        raise VideoError(f"video must be a sequence of frames, got {type(frames).__name__}")
    return list(frames)


@dataclass(frozen=True)
class VideoSampling:
    """Which of a video's frames are encoded, and the timestamps the prompt gives them: settled from the frame count
    and the rates alone, before any frame is decoded."""

    indices: np.ndarray  # int64, source frame indices (before temporal padding)
    timestamps: tuple[float, ...]  # seconds, one per temporal patch
    video_fps: float


def sample_video(
    total_frames: int,
    video_fps: float,
    config: VideoProcessorConfig,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    sample: bool | None = None,
) -> VideoSampling:
    """The frames of a `total_frames`-frame video at `video_fps` that are encoded (`sample_frame_indices`; every
    frame with `sample=False`, or when the config does not sample) and their timestamps; a `VideoError` for rates or
    counts it refuses, fewer sampled frames than a temporal patch among them."""
    video_fps = _check_fps(video_fps, "video_fps")
    do_sample = config.do_sample_frames if sample is None else sample
    if do_sample:
        indices = sample_frame_indices(total_frames, video_fps, config, fps=fps, num_frames=num_frames)
    elif total_frames <= 0:
        raise VideoError("video has no frames")
    else:
        indices = np.arange(total_frames, dtype=np.int64)
    if len(indices) < config.temporal_patch_size:  # (HF's smart resize refuses it, once the frames are decoded)
        raise VideoError(f"video has {len(indices)} sampled frames; at least {config.temporal_patch_size} are needed")
    stamps = frame_group_timestamps(indices, video_fps, config.temporal_patch_size)
    return VideoSampling(indices=indices, timestamps=tuple(stamps), video_fps=video_fps)


def preprocess_video(
    frames: Sequence[Frame] | np.ndarray,
    video_fps: float,
    config: VideoProcessorConfig,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    sample: bool | None = None,
    limits: DecodeLimits = DEFAULT_LIMITS,
) -> PreprocessedVideo:
    """Decoded frames (PIL images or uint8 [H, W, 3] arrays, all the same size) at `video_fps` ->
    pixel_values_videos, grid_thw and per-temporal-patch timestamps. `sample=False` keeps every frame
    (frames already sampled by the caller; their indices are then 0..F-1 at `video_fps`)."""
    frame_list = _frame_list(frames)
    if not frame_list:
        raise VideoError("video has no frames")
    sampling = sample_video(len(frame_list), video_fps, config, fps=fps, num_frames=num_frames, sample=sample)
    return preprocess_sampled_frames(decode_sampled_frames(frame_list, sampling.indices, limits), sampling, config)


def decode_sampled_frames(frames: Sequence[Frame | bytes], indices: np.ndarray,
                          limits: DecodeLimits = DEFAULT_LIMITS) -> list[Image.Image]:
    """The RGB images of `frames[i]` for each sampled index i, each frame decoded (or converted) once however often
    it is sampled."""
    rgb: dict[int, Image.Image] = {}
    for i in indices.tolist():
        if i not in rgb:
            try:
                rgb[i] = to_rgb_image(frames[i], limits, what=f"video frame {i}")  # type: ignore[arg-type]
            except MediaDecodeError as exc:  # (encoded bytes: say which frame, as the other refusals do)
                raise MediaDecodeError(f"video frame {i} is not a decodable image: {exc}") from exc
    return [rgb[i] for i in indices.tolist()]


def preprocess_sampled_frames(
    rgb: Sequence[Image.Image], sampling: VideoSampling, config: VideoProcessorConfig
) -> PreprocessedVideo:
    """The sampled frames, decoded (one RGB image per index of `sampling`) -> the video for the encoder."""
    if len(rgb) != len(sampling.indices):
        raise VideoError(f"{len(rgb)} frames for {len(sampling.indices)} sampled indices")
    sizes = {im.size for im in rgb}
    if len(sizes) != 1:
        raise VideoError(f"all video frames must have one size, got {sorted(sizes)}")
    width, height = rgb[0].size
    n = len(rgb)
    new_h, new_w = video_smart_resize(
        n,
        height,
        width,
        temporal_factor=config.temporal_patch_size,
        factor=config.factor,
        min_pixels=config.min_pixels,
        max_pixels=effective_max_pixels(n, config),
    )
    # a frame sampled several times is one image in `rgb` (`decode_sampled_frames`): resized once
    once: dict[int, np.ndarray] = {}
    for im in rgb:
        if id(im) not in once:
            once[id(im)] = resize_rgb(im, new_h, new_w)
    resized = np.stack([once[id(im)] for im in rgb])  # [F, H, W, 3] uint8
    if pad := -n % config.temporal_patch_size:
        resized = np.concatenate([resized, np.repeat(resized[-1:], pad, axis=0)])
    pixels = normalize(resized, config.image_mean, config.image_std, config.rescale_factor)
    flat, grid = patchify(
        pixels,
        patch_size=config.patch_size,
        merge_size=config.merge_size,
        temporal_patch_size=config.temporal_patch_size,
    )
    return PreprocessedVideo(
        pixel_values_videos=torch.from_numpy(flat),
        grid_thw=grid,
        frame_indices=tuple(sampling.indices.tolist()),
        timestamps=sampling.timestamps,
        video_fps=sampling.video_fps,
        resized_size=(new_h, new_w),
    )
