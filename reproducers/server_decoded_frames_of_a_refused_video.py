"""Found in session 36: over HTTP, the server decoded a request's video frames before refusing what needed no pixel.
Six frames of 640 x 480 at fps=1e-300 were all decoded (and their data URLs cached) before the engine refused the
rate (its timestamps past 2**49 s); a one-frame video was decoded by the server and again by the engine before the
smart resize refused it (fewer frames than a temporal patch); frames past `max_video_pixels` were decoded up to the
one that crossed it. Fixed when the server settles each video's sampling before fetching a frame and judges every
frame's header before decoding any: each is a 4xx with no pixel decoded and nothing cached."""

import base64
import io

import _common
import httpx
from PIL import Image, ImageFile

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

WIDTH, HEIGHT = 640, 480


def frame(colour: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (WIDTH, HEIGHT), (colour, 3, 5)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


decodes = []  # every pixel load of an opened image, whoever decodes it (the server's threads or the engine)
load = ImageFile.ImageFile.load
ImageFile.ImageFile.load = lambda self: decodes.append(self.size) or load(self)

served = serve_in_thread(ServerSettings(max_video_pixels=7 * WIDTH * HEIGHT))
state = served.app.state.prism
wrong = []
try:
    for what, frames, fps, status in [("6 frames at fps=1e-300", 6, 1e-300, 400),
                                      ("a one-frame video", 1, 2.0, 400),
                                      ("8 frames, 7 within max_video_pixels", 8, 2.0, 413)]:
        decodes.clear()
        video = {"type": "video", "video": {"frames": [frame(i) for i in range(frames)], "fps": fps}}
        body = {"model": "prism-tiny", "messages": [{"role": "user", "content": [video]}], "max_tokens": 2}
        response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120)
        cached = state.resolver._decoded.nbytes
        if response.status_code != status or decodes or cached:
            wrong.append(f"{what}: {response.status_code} after {len(decodes)} pixel loads of its frames, {cached} bytes of data "
                         f"URLs cached ({response.text[:160]})")
finally:
    served.stop()
_common.verdict(not wrong, "each refused video is a 4xx with no frame decoded and nothing cached", "; ".join(wrong))
