"""Spec of a video's frame sampling and timestamps (`media.video.preprocess_video`, `media.video.sample_video`) over
every frame rate a request may give: any positive finite float (the server's `VideoFrames.fps`), subnormal ones and
ones near the largest included; and over every frame count (`num_frames`) the offline API may give.

Either the video is made, sampled as HF's `Qwen3VLVideoProcessor.sample_frames` samples it, its timestamps
HF's `Qwen3VLProcessor._calculate_timestamps` and their text HF's `<{t:.1f} seconds>`; or it is a `VideoError` (a 400
over HTTP), and then HF does not make it either (its sampling overflows, a timestamp is not finite, or fewer frames
than a temporal patch are sampled), or HF's text would be the digits of a float that no longer tells tenths of a
second apart (a timestamp whose float neighbours are more than 0.1 s away: a video_fps of 1e-300 gave HF, and Prism
before the review of session 35, 300-digit timestamps). Never another exception: that would be a 500.

A frame count is sampled as HF samples it up to the processor's `max_frames`, the most frames it samples a video to
at any fps; a larger one is a `VideoError` naming that limit, refused before anything is sampled (HF samples any
count: 10**12 asked it for a 7 TiB array of indices, the review of session 35). A count below a temporal patch is a
`VideoError` as it is sampled (HF samples it, then refuses it at its resize, once the frames are decoded).

A checkpoint's own frame count (its video processor config's `num_frames`, which every video is sampled to) loads
exactly when it is at most the config's `max_frames`, and then every video is sampled as HF samples it to that count;
a larger one is a `MediaConfigError` naming the value and the limit, so that the engine does not start (session 36:
`num_frames=10**9` loaded, and every video request was then refused, blamed on a `num_frames` the request never gave).
HF refuses a config whose `num_frames` and `fps` are both set ("mutually exclusive"); here the count wins.

A checkpoint's own sampling rate (its `fps`) loads exactly when it is a positive finite number of at most
`media.rates.MAX_SAMPLING_FPS`, the check a request's rates get; then every video whose timestamps fit, the longest
such too (two frames 2**50 seconds apart, less a tick), is sampled as HF samples it at that rate. Any other is a
`MediaConfigError` naming the file and the value (session 37: `fps` of inf loaded and every video was then refused; one
of 1e300 loaded and refused every video longer than 1.8e8 seconds of frames, 256 frames a fortnight apart, blamed on
its `video_fps`; HF's sampling overflows for both).
"""

from __future__ import annotations

import json
import math
import tempfile
import types
from pathlib import Path

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from prism.media.config import VideoProcessorConfig
from prism.media.errors import MediaConfigError, VideoError
from prism.media.rates import MAX_SAMPLING_FPS
from prism.media.video import preprocess_video, sample_video

CFG = VideoProcessorConfig(min_pixels=2 * 32 * 32, max_pixels=16 * 32 * 32)


def _hf(total: int, video_fps: float, sample: bool, cfg: VideoProcessorConfig = CFG
        ) -> tuple[list[int], list[float]] | None:
    """HF's sampled indices and timestamps for `total` frames at `video_fps` under `cfg`; None where HF fails or would
    not make the video (fewer frames than a temporal patch; a timestamp that is not finite)."""
    stub = types.SimpleNamespace(fps=cfg.fps, min_frames=cfg.min_frames, max_frames=cfg.max_frames)
    try:
        if sample:
            meta = VideoMetadata(total_num_frames=total, fps=video_fps)
            indices = np.asarray(Qwen3VLVideoProcessor.sample_frames(stub, meta)).tolist()
        else:
            indices = list(range(total))
        stamps = Qwen3VLProcessor._calculate_timestamps(None, list(indices), video_fps, cfg.temporal_patch_size)
    except (OverflowError, ValueError):
        return None
    if len(indices) < cfg.temporal_patch_size or not all(map(math.isfinite, stamps)):
        return None
    if any(np.spacing(t) > 0.1 for t in stamps):  # HF makes it, but its text shows digits the float does not hold
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
@example(total=4, video_fps=1e-300, sample=False)
@example(total=2, video_fps=float(np.nextafter(2.0**-50, 1)), sample=False)  # 2**49 - 1/8 s: the last one kept
@example(total=2, video_fps=2.0**-50, sample=False)  # (0 + 2**50) / 2 = 2**49 s: the first one refused
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
    assert video.timestamp_texts() == [f"<{t:.1f} seconds>" for t in stamps], video.timestamp_texts()
    assert len(video.timestamps) == video.grid_thw[0]


FEW = VideoProcessorConfig(min_pixels=2 * 32 * 32, max_pixels=16 * 32 * 32, min_frames=2, max_frames=12)


@settings(max_examples=100, deadline=None)
@given(total=st.integers(1, 24), num_frames=st.integers(1, 48), video_fps=st.floats(0.5, 60.0))
@example(total=4, num_frames=13, video_fps=2.0)  # one past max_frames
@example(total=4, num_frames=12, video_fps=2.0)  # max_frames, three times over the frames given
@example(total=4, num_frames=10**12, video_fps=2.0)  # HF: "Unable to allocate 7.28 TiB"
def spec_a_frame_count_is_sampled_as_hf_up_to_max_frames(total, num_frames, video_fps) -> None:
    stub = types.SimpleNamespace(fps=FEW.fps, min_frames=FEW.min_frames, max_frames=FEW.max_frames)
    try:
        sampling = sample_video(total, video_fps, FEW, num_frames=num_frames)
    except VideoError as error:
        if num_frames < FEW.temporal_patch_size:  # HF samples it, then refuses it at its resize
            assert f"at least {FEW.temporal_patch_size}" in str(error), str(error)
            return
        assert num_frames > FEW.max_frames, f"num_frames={num_frames} of {total} frames refused: {error}"
        assert f"max_frames={FEW.max_frames}" in str(error), str(error)
        return
    except Exception as error:  # what an unbounded count raised (a MemoryError): a 500, not a clear refusal
        raise AssertionError(f"num_frames={num_frames} raised {type(error).__name__}: {error}") from error
    assert num_frames <= FEW.max_frames, f"num_frames={num_frames} sampled, past max_frames={FEW.max_frames}"
    meta = VideoMetadata(total_num_frames=total, fps=video_fps)
    indices = np.asarray(Qwen3VLVideoProcessor.sample_frames(stub, meta, num_frames=num_frames)).tolist()
    assert sampling.indices.tolist() == indices, f"sampled {sampling.indices.tolist()}, HF {indices}"
    stamps = Qwen3VLProcessor._calculate_timestamps(None, list(indices), video_fps, FEW.temporal_patch_size)
    assert list(sampling.timestamps) == stamps, f"timestamps {sampling.timestamps}, HF {stamps}"


@settings(max_examples=60, deadline=None)
@given(num_frames=st.integers(1, 2**40), max_frames=st.integers(2, 48), with_fps=st.booleans(),
       total=st.integers(1, 24), video_fps=st.floats(0.5, 60.0))
@example(num_frames=10**9, max_frames=768, with_fps=False, total=4, video_fps=2.0)  # session 36's checkpoint
@example(num_frames=13, max_frames=12, with_fps=True, total=4, video_fps=2.0)  # one past max_frames
@example(num_frames=12, max_frames=12, with_fps=False, total=4, video_fps=2.0)  # max_frames, three times the frames
def spec_a_checkpoints_frame_count_loads_iff_within_max_frames(num_frames, max_frames, with_fps, total,
                                                               video_fps) -> None:
    raw = {"num_frames": num_frames, "max_frames": max_frames, "min_frames": 2} | ({} if with_fps else {"fps": None})
    try:
        config = VideoProcessorConfig.from_dict(raw)
    except MediaConfigError as error:
        assert num_frames > max_frames, f"a checkpoint's num_frames={num_frames} refused, max_frames={max_frames}: " \
                                        f"{error}"
        assert f"num_frames={num_frames}" in str(error) and f"max_frames={max_frames}" in str(error), str(error)
        return
    assert num_frames <= max_frames, f"a checkpoint's num_frames={num_frames} loaded, past max_frames={max_frames}"
    stub = types.SimpleNamespace(fps=None, min_frames=2, max_frames=max_frames)
    meta = VideoMetadata(total_num_frames=total, fps=video_fps)
    indices = np.asarray(Qwen3VLVideoProcessor.sample_frames(stub, meta, num_frames=num_frames)).tolist()
    try:
        sampling = sample_video(total, video_fps, config)
    except VideoError as error:
        assert num_frames < config.temporal_patch_size, \
            f"{total} frames refused under a checkpoint's num_frames={num_frames} (HF samples {indices}): {error}"
        return
    assert sampling.indices.tolist() == indices, f"sampled {sampling.indices.tolist()}, HF {indices}"


LONGEST_RATE = float(np.nextafter(2.0**-50, 1))  # two frames at it: one timestamp, the last below 2**49 s
_config_rates = st.one_of(
    st.floats(), st.integers(-2, 10**6), st.booleans(),
    st.sampled_from([math.inf, 1e300, MAX_SAMPLING_FPS, float(np.nextafter(MAX_SAMPLING_FPS, math.inf)), 2.0, 1e-300]),
)


@settings(max_examples=80, deadline=None)
@given(fps=_config_rates, total=st.integers(2, 300),
       video_fps=st.floats(min_value=0.0, exclude_min=True, allow_infinity=False, allow_nan=False))
@example(fps=math.inf, total=64, video_fps=30.0)  # every video refused, blamed on "target fps"
@example(fps=1e300, total=256, video_fps=1e-6)  # a frame every 11.6 days, blamed on its video_fps
@example(fps=MAX_SAMPLING_FPS, total=2, video_fps=1.0)  # the most: loads
@example(fps=float(np.nextafter(MAX_SAMPLING_FPS, math.inf)), total=2, video_fps=1.0)  # one past it
@example(fps=True, total=4, video_fps=2.0)
def spec_a_checkpoints_sampling_rate_loads_iff_every_video_is_sampled_as_hf(fps, total, video_fps) -> None:
    rate_ok = (not isinstance(fps, bool) and math.isfinite(fps) and 0 < fps <= MAX_SAMPLING_FPS)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "video_preprocessor_config.json"
        path.write_text(json.dumps({"fps": fps}))  # (inf and nan as JSON's Infinity and NaN, as Python writes them)
        try:
            config = VideoProcessorConfig.from_json_file(path)
        except MediaConfigError as error:
            assert not rate_ok, f"a checkpoint's fps={fps!r} refused: {error}"
            assert str(path) in str(error) and repr(fps) in str(error), f"fps={fps!r} refused as: {error}"
            return
    try:
        longest = sample_video(2, LONGEST_RATE, config)
    except VideoError as error:
        raise AssertionError(f"a checkpoint's fps={fps!r} loaded, then refused two frames {1 / LONGEST_RATE:.6g} s apart, "
                             f"whose timestamp fits: {error}") from error
    assert longest.indices.tolist() == [0, 1] and longest.timestamps == ((0 / LONGEST_RATE + 1 / LONGEST_RATE) / 2,)
    assert rate_ok and config.fps == fps, f"a checkpoint's fps={fps!r} loaded as {config.fps!r}"
    expected = _hf(total, video_fps, True, config)
    try:
        sampled = sample_video(total, video_fps, config)
    except VideoError as error:
        assert expected is None, f"a checkpoint's fps={fps!r} loaded, then {total} frames at {video_fps!r} fps " \
                                 f"refused ({error}) but HF samples {expected}"
        return
    assert expected is not None, f"fps={fps!r}: {total} frames at {video_fps!r} fps made a video HF does not make"
    assert (sampled.indices.tolist(), list(sampled.timestamps)) == expected, \
        f"fps={fps!r}: {total} frames at {video_fps!r} fps sampled {sampled.indices.tolist()}, HF {expected[0]}"
