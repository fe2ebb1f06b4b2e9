"""Found by the media hunt (session 30): video frames had a per-request budget of decoded pixels (max_video_pixels),
images none. Each image alone is bounded from its header (~89 M pixels), but a request may carry 16 of them: a few KB
of flat-colour PNG decoded to GBs of pixels and seconds of CPU. Fixed when a request's images may announce at most
max_image_pixels (2**28: 16 images of 4096 x 4096) in all, judged from their headers before any is decoded (a 413).
Here 16 flat PNGs of 4100 x 4100, one pixel row and column past Qwen3-VL's largest image each, go to a default
server (before the fix: a 200 after 167 s on the development machine's CPU, decoding, encoding and prefilling them;
now a 413 in 0.14 s)."""

import base64
import struct
import time
import zlib

import _common
import httpx  # noqa: E402

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

SIDE, IMAGES = 4100, 16


def flat_png(side: int, colour: tuple[int, int, int], pixels: bytes) -> bytes:
    """A 1-bit palette PNG of one colour (its pixel data compressed once, shared by every colour)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 1, 3, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"PLTE", bytes(colour)) + chunk(b"IDAT", pixels)
            + chunk(b"IEND", b""))


pixels = zlib.compress((b"\0" * (1 + (SIDE + 7) // 8)) * SIDE, 9)
pngs = [flat_png(SIDE, (i * 16, 255 - i * 16, 128), pixels) for i in range(IMAGES)]
content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()}}
           for p in pngs] + [{"type": "text", "text": "What colours are these?"}]
served = serve_in_thread(ServerSettings())  # the embedded tiny checkpoint, default limits
body = {"model": served.app.state.prism.settings.served_model_name, "messages": [{"role": "user", "content": content}],
        "max_tokens": 1}
start = time.perf_counter()
response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=300)
took = time.perf_counter() - start
served.server.should_exit = True
said = response.json().get("error", {}).get("message", "") if response.status_code != 200 else "an answer"
announced = IMAGES * SIDE * SIDE
_common.verdict(
    response.status_code == 413 and "max_image_pixels" in said and str(announced) in said,
    f"{IMAGES} PNGs of {SIDE}x{SIDE} ({sum(map(len, pngs)) // 1024} KB) refused in {took:.2f} s: {said}",
    f"{IMAGES} PNGs of {SIDE}x{SIDE} ({sum(map(len, pngs)) // 1024} KB, {announced} pixels in all): "
    f"{response.status_code} ({said[:120]}) after {took:.1f} s: decoded (and computed), no per-request budget of "
    "image pixels",
)
