"""Found by the media bug hunt: a video whose frames were sent at a tiny (subnormal) frame rate, which the protocol
accepts (any positive finite fps), made HF's sampling count `int(frames / fps * 2)` an OverflowError: a 500 over
HTTP. Fixed when that is a `VideoError` (a 400) naming video_fps."""

import _common  # noqa: F401
import numpy as np

from prism.media.config import VideoProcessorConfig
from prism.media.errors import VideoError
from prism.media.video import preprocess_video

frames = [np.zeros((32, 32, 3), np.uint8)] * 4
try:
    preprocess_video(frames, 5e-324, VideoProcessorConfig())
    outcome, ok = "made a video", False
except VideoError as error:
    outcome, ok = f"a VideoError: {error}", "video_fps" in str(error)
except Exception as error:  # noqa: BLE001 - what the bug raised
    outcome, ok = f"{type(error).__name__}: {error}", False

_common.verdict(ok, f"4 frames at 5e-324 fps are {outcome}", f"4 frames at 5e-324 fps raised {outcome}")
