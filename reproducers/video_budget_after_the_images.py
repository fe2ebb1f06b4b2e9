"""Found by session 34's review of the video pixel budget: a prompt's videos were sampled and checked against
`max_video_pixels` only after its images were prepared, so a prompt refused for its videos had already decoded its
images, put them in the preprocessing cache and (in the engine, `encode_media_while_preparing`) encoded them on the
device. Fixed when the videos' sampling and budget are settled first (`MediaPreparer.plan_videos`): the refused
prompt decodes and caches nothing."""

import io
from unittest import mock

import _common
import numpy as np
from PIL import Image

from prism.engine.inputs import InputProcessor  # noqa: E402
from prism.media import image as media_image  # noqa: E402
from prism.media.errors import VideoPixelBudgetError  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

picture = io.BytesIO()
Image.fromarray(np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(picture, "PNG")
frames = [np.zeros((64, 64, 3), np.uint8)] * 4  # 4 frames of 4096 pixels, all sampled at 2 fps: past 8192
proc = InputProcessor(ensure_tiny_checkpoint(), cache_bytes=2**24, max_video_pixels=8192)
chat = [{"role": "user", "content": [{"type": "image", "image": picture.getvalue()},
                                     {"type": "video", "video": frames, "fps": 2.0},
                                     {"type": "text", "text": "What happens?"}]}]
decoded = []
decode = media_image.decode_image


def counted(data, limits=media_image.DEFAULT_LIMITS):
    decoded.append(data)
    return decode(data, limits)


with mock.patch.object(media_image, "decode_image", counted):
    try:
        proc.prepare_chat(chat)
        outcome = "prepared"
    except VideoPixelBudgetError as error:
        outcome = f"refused: {error}"
cached = len(proc.cache)
_common.verdict(
    outcome.startswith("refused") and not decoded and cached == 0,
    f"a prompt over max_video_pixels decoded nothing and cached nothing ({outcome})",
    f"a prompt over max_video_pixels ({outcome}) decoded {len(decoded)} image(s) and left {cached} cache entries",
)
