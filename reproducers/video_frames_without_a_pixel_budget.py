"""Found by the review of session 35: offline (`LLM`, `InputProcessor`), the frames of a prompt's videos had no pixel
budget. Over HTTP the server decodes the frames under `max_video_pixels` itself, but the engine counted nothing: 8
flat PNG frames of 4200 x 4200 (a few KB each, 141 M pixels in all) were decoded, each twice, and resized. Fixed when
the frames a prompt's videos sample may announce at most `max_video_pixels` (2**27) in all, judged from their headers
before any is decoded: a `VideoPixelBudgetError` (an `ImagePixelBudgetError`, a 413 over HTTP)."""

import io
import time

import _common
from PIL import Image

from prism.engine.inputs import InputProcessor  # noqa: E402
from prism.media.errors import ImageTooLargeError  # noqa: E402
from prism.media.image import header_size  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

SIDE, FRAMES = 4200, 8


def flat_png(colour: int) -> bytes:
    out = io.BytesIO()
    Image.new("P", (SIDE, SIDE), colour).save(out, "PNG")
    return out.getvalue()


frames = [flat_png(i) for i in range(FRAMES)]
assert all(header_size(f) == (SIDE, SIDE) for f in frames)
proc = InputProcessor(ensure_tiny_checkpoint())
chat = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 2.0, "num_frames": FRAMES},
                                     {"type": "text", "text": "What happens?"}]}]
start = time.perf_counter()
try:
    proc.prepare_chat(chat)
    outcome, ok = "prepared", False
except ImageTooLargeError as error:
    outcome, ok = f"{type(error).__name__}: {error}", "max_video_pixels" in str(error)
took = time.perf_counter() - start
announced = FRAMES * SIDE * SIDE
_common.verdict(
    ok,
    f"{FRAMES} PNG frames of {SIDE}x{SIDE} ({announced} pixels) refused in {took:.2f} s: {outcome}",
    f"{FRAMES} PNG frames of {SIDE}x{SIDE} ({sum(map(len, frames)) // 1024} KB, {announced} pixels in all): "
    f"{outcome} after {took:.1f} s: decoded, no per-prompt budget of video frame pixels",
)
