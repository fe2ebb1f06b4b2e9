"""Found by session 34's review: the server refused a video frame that alone announces more than one frame may have
(89,478,485 pixels, Prism's per-image limit) as "the decoded video frames of this request exceed
max_video_pixels=134217728", though the request was far within that budget: the client was told to lower the wrong
thing. Fixed when such a frame's 413 names the frame's own limit."""

import base64
import struct
import warnings
import zlib

import _common
from PIL import Image

from prism.serving.media_urls import MediaResolver, MediaTooLarge  # noqa: E402
from prism.serving.protocol import parse_chat_request  # noqa: E402
from prism.serving.settings import ServerSettings  # noqa: E402


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


# a PNG header announcing 9500 x 9500 = 90,250,000 pixels (no picture behind it: refused from the header)
frame = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 9500, 9500, 8, 0, 0, 0, 0))
         + chunk(b"IDAT", zlib.compress(bytes(16))) + chunk(b"IEND", b""))
url = "data:image/png;base64," + base64.b64encode(frame).decode()
messages = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [  # (two frames: one alone is
    {"type": "video", "video": {"frames": [url, url], "fps": 2.0}}]}]}).messages  # refused for its sampling first)
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        MediaResolver(ServerSettings()).resolve_messages(messages)
    message = "accepted"
except MediaTooLarge as error:
    message = error.message
_common.verdict("max_video_pixels" not in message and "89478485" in message,
                f"a 90 M pixel frame's 413 names the frame limit: {message}",
                f"a 90 M pixel frame, within max_video_pixels=2**27, refused as: {message}")
