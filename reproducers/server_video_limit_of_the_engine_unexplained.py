"""Found by session 34's review: once the engine had a video pixel budget of its own (`EngineConfig.max_video_pixels`,
2**27 by default), the server refused at the lower of it and `PRISM_MAX_VIDEO_PIXELS`, so an operator who had raised
the variable (PRISM_MAX_VIDEO_PIXELS=2**30, which alone used to raise the limit) got 413s at 2**27 whose message
named `max_video_pixels=134217728` and nothing of where that came from. Fixed when such a 413 says the limit is the
engine config's, below the variable's value (the README says to set both)."""

import base64
import io

import _common
from PIL import Image

from prism.serving.media_urls import MediaResolver, MediaTooLarge  # noqa: E402
from prism.serving.protocol import parse_chat_request  # noqa: E402
from prism.serving.settings import ServerSettings  # noqa: E402


def frame(colour: int) -> str:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (colour, 0, 0)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


messages = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [
    {"type": "video", "video": {"frames": [frame(i) for i in range(4)], "fps": 2.0}}]}]}).messages
# As `ServerState` builds it: PRISM_MAX_VIDEO_PIXELS=2**30, the engine config's max_video_pixels 128 (4 frames: 256).
resolver = MediaResolver(ServerSettings(max_video_pixels=2**30), max_video_pixels=128)
try:
    resolver.resolve_messages(messages)
    message = "accepted"
except MediaTooLarge as error:
    message = error.message
_common.verdict("engine config" in message and f"PRISM_MAX_VIDEO_PIXELS={2**30}" in message,
                f"the 413 says whose limit it is: {message}",
                f"PRISM_MAX_VIDEO_PIXELS={2**30}, refused at the engine's 128 without saying so: {message}")
