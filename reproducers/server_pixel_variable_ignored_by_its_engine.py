"""Found in session 34: the engine a server builds took its pixel budgets from its `PRISM_CONFIG` file or the defaults,
never from the server's `PRISM_MAX_IMAGE_PIXELS` / `PRISM_MAX_VIDEO_PIXELS`. The README advised raising
`PRISM_MAX_IMAGE_PIXELS` for albums of large photos (twelve 24 M-pixel photos are 288 M pixels, past the 2**28
default), but the server refuses at the lower of its own and its engine's limit, and the engine stayed at 2**28: the
variable changed nothing. Fixed: the server's budgets are the engine's wherever the config file names none."""

import _common  # noqa: F401

from prism.serving.server_state import build_engine  # noqa: E402
from prism.serving.settings import ServerSettings  # noqa: E402

settings = ServerSettings.from_env({"PRISM_MAX_IMAGE_PIXELS": str(2**30), "PRISM_MAX_VIDEO_PIXELS": str(2**29)})
engine = build_engine(settings)  # the embedded tiny checkpoint (PRISM_MODEL unset)
try:
    got = engine.inputs.max_image_pixels, engine.inputs.max_video_pixels
finally:
    engine.shutdown()
_common.verdict(got == (2**30, 2**29), f"the engine's budgets are the variables': {got}",
                f"PRISM_MAX_IMAGE_PIXELS=2**30 and PRISM_MAX_VIDEO_PIXELS=2**29 set, the engine's budgets {got}")
