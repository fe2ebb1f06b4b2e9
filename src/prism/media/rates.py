"""Owns what a frame rate may be, wherever one comes from: a request's (the rate its frames were taken at,
`video_fps`), a video processor config's (the rate videos are sampled at, `fps`) or a caller's sampling override.

- Any rate is a positive finite number (a bool is not one): `checked_rate`.
- The `<t seconds>` timestamps the model reads stay below `MAX_TIMESTAMP_SECONDS` (`media.video` refuses a video whose
  timestamps do not), so a video that is made lasts less than 4 * 2**49 = 2**51 seconds of frames (its last
  timestamp is at least a quarter of its frame count over its rate, for the 2 frames or more it samples).
- A sampling rate is at most `MAX_SAMPLING_FPS`: then the frame count any such video is sampled to before its clamps
  (frames / video_fps * fps, HF's `sample_frames`) is a float, and a rate past it is refused where it is given (a
  checkpoint's at load, naming its file), not blamed later on a request's `video_fps` (an `fps` of inf, or of 1e300,
  loaded and then refused every video, or every 30 fps one, as a `video_fps` too small).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

# The first time whose float64 neighbours are more than a tenth of a second apart (spacing 2**(49 - 52)): the
# `<t seconds>` text of a time from there on shows digits the float does not hold.
MAX_TIMESTAMP_SECONDS = 2.0**49
# A duration under 4 * MAX_TIMESTAMP_SECONDS times a rate up to this is below the largest float, rounded or not.
MAX_SAMPLING_FPS = sys.float_info.max / (4 * MAX_TIMESTAMP_SECONDS)


def checked_rate(value: Any, name: str, error: Callable[[str], Exception]) -> float:
    """`value` as a float once it is a positive finite number; else `error(message)` naming `name` and the value."""
    if (value is None or isinstance(value, bool) or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value > 0)):
        raise error(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def checked_sampling_rate(value: Any, name: str, error: Callable[[str], Exception]) -> float:
    """`checked_rate`, and at most `MAX_SAMPLING_FPS` frames a second."""
    rate = checked_rate(value, name, error)
    if rate > MAX_SAMPLING_FPS:
        raise error(f"{name}={value!r} is past the most frames a second a video is sampled at, {MAX_SAMPLING_FPS:.6g}: "
                    "a video whose timestamps fit (up to 2**51 seconds of frames) would have more frames to sample than "
                    "a float holds")
    return rate
