"""Found in session 37: over HTTP, the server decoded every frame of a video it accepted and handed them all to the
engine, which sampled them again and used only the sampled ones. A 30 fps video of 64 frames samples 4 (Qwen3-VL's
2 fps, at least its min_frames of 4): the server decoded 64 (17 of 256 frames sampled: 15 times the work). Fixed when
the server hands the frames over encoded and the engine decodes only the frames it samples, each once: 4 decodes for
the same answer."""

import base64
import io

import _common
import httpx
import numpy as np
from PIL import Image, ImageFile

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

FRAMES, FPS, SAMPLED = 64, 30.0, 4


def frame(seed: int) -> str:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (120, 160, 3), dtype=np.uint8)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


decodes = []  # every decode of an opened image's pixels, whoever decodes them (the server's threads or the engine)
load = ImageFile.ImageFile.load
ImageFile.ImageFile.load = lambda self: (decodes.append(self.size) if self.tile else None) or load(self)

video = {"type": "video", "video": {"frames": [frame(i) for i in range(FRAMES)], "fps": FPS}}
body = {"model": "prism-tiny", "messages": [{"role": "user", "content": [video, {"type": "text", "text": "What?"}]}],
        "max_tokens": 2}
served = serve_in_thread(ServerSettings())
try:
    response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120)
finally:
    served.stop()
_common.verdict(response.status_code == 200 and len(decodes) == SAMPLED,
                f"a {FPS:g} fps video of {FRAMES} frames: {len(decodes)} frames decoded, the {SAMPLED} it samples",
                f"a {FPS:g} fps video of {FRAMES} frames: HTTP {response.status_code}, {len(decodes)} frames decoded "
                f"for the {SAMPLED} it samples ({response.text[:160]})")
