"""Spec of a video's frame sampling and timestamps (`media.video.preprocess_video`) over every frame rate a request
may give: any positive finite float (the server's `VideoFrames.fps`), subnormal ones and ones near the largest
included.

Either the video is made, sampled as HF's `Qwen3VLVideoProcessor.sample_frames` samples it, its timestamps
HF's `Qwen3VLProcessor._calculate_timestamps` and all finite; or it is a `VideoError` (a 400 over HTTP), and then
HF does not make it either (its sampling overflows, a timestamp is not finite, or fewer frames than a temporal
patch are sampled). Never another exception: that would be a 500.
"""

from __future__ import annotations

import math
import types

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from prism.media.config import VideoProcessorConfig
from prism.media.errors import VideoError
from prism.media.video import preprocess_video

CFG = VideoProcessorConfig(min_pixels=2 * 32 * 32, max_pixels=16 * 32 * 32)


def _hf(total: int, video_fps: float, sample: bool) -> tuple[list[int], list[float]] | None:
    """HF's sampled indices and timestamps for `total` frames at `video_fps`; None where HF fails or would not make
    the video (fewer frames than a temporal patch; a timestamp that is not finite)."""
    stub = types.SimpleNamespace(fps=CFG.fps, min_frames=CFG.min_frames, max_frames=CFG.max_frames)
    try:
        if sample:
            meta = VideoMetadata(total_num_frames=total, fps=video_fps)
            indices = np.asarray(Qwen3VLVideoProcessor.sample_frames(stub, meta)).tolist()
        else:
            indices = list(range(total))
        stamps = Qwen3VLProcessor._calculate_timestamps(None, list(indices), video_fps, CFG.temporal_patch_size)
    except (OverflowError, ValueError):
        return None
    if len(indices) < CFG.temporal_patch_size or not all(map(math.isfinite, stamps)):
        return None
    return indices, stamps


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(1, 24),
    video_fps=st.floats(min_value=0.0, exclude_min=True, allow_infinity=False, allow_nan=False),
    sample=st.booleans(),
)
@example(total=4, video_fps=5e-324, sample=True)
@example(total=4, video_fps=4e-308, sample=True)
@example(total=4, video_fps=1e-310, sample=False)
def spec_any_frame_rate_is_a_video_or_a_video_error(total, video_fps, sample) -> None:
    frames = [np.full((8, 8, 3), i, dtype=np.uint8) for i in range(total)]
    expected = _hf(total, video_fps, sample)
    try:
        video = preprocess_video(frames, video_fps, CFG, sample=sample)
    except VideoError as error:
        assert expected is None, f"{total} frames at {video_fps!r} fps refused ({error}) but HF samples {expected}"
        return
    assert expected is not None, f"{total} frames at {video_fps!r} fps made a video HF does not make"
    indices, stamps = expected
    assert list(video.frame_indices) == indices, f"sampled {video.frame_indices}, HF {indices}"
    assert list(video.timestamps) == stamps, f"timestamps {video.timestamps}, HF {stamps}"
    assert len(video.timestamps) == video.grid_thw[0]
