"""Found by the review of session 35: offline, each sampled video frame given as encoded bytes was decoded twice, once
to key the video in the preprocessing cache and again by `preprocess_video` for its pixels. Fixed when each sampled
frame is decoded once (and a frame sampled twice still once)."""

import io
from unittest import mock

import _common
import numpy as np
from PIL import Image

from prism.engine.inputs import InputProcessor  # noqa: E402
from prism.media import image as media_image  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402


def png(seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


frames = [png(i) for i in range(4)]  # at the tiny checkpoint's 2 fps, all 4 are sampled
proc = InputProcessor(ensure_tiny_checkpoint(), cache_bytes=2**24)
decoded = []
decode = media_image.decode_image


def counted(data, limits=media_image.DEFAULT_LIMITS):
    decoded.append(data)
    return decode(data, limits)


chat = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 2.0},
                                     {"type": "text", "text": "What happens?"}]}]
with mock.patch.object(media_image, "decode_image", counted):
    proc.prepare_chat(chat)
_common.verdict(len(decoded) == len(frames), f"{len(frames)} PNG frames decoded {len(decoded)} times",
                f"{len(frames)} PNG frames decoded {len(decoded)} times (each once expected)")
