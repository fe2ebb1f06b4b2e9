"""Found by the review of session 35: a video at fps=1e-300 (any positive finite rate was accepted, offline and
over HTTP) put its frames 1e300 seconds apart, and the prompt read `<2499999999...0.0 seconds>`: 313-character
timestamps, HF's `{t:.1f}` of floats that no longer tell tenths of a second apart (HF prints the same). Fixed when a
timestamp of 2**49 s or more (where float64 neighbours are more than 0.1 s apart) is a `VideoError` saying so."""

import _common
import numpy as np

from prism.engine.inputs import InputProcessor  # noqa: E402
from prism.media.errors import VideoError  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

proc = InputProcessor(ensure_tiny_checkpoint())
chat = [{"role": "user", "content": [{"type": "video", "video": [np.zeros((32, 32, 3), np.uint8)] * 4, "fps": 1e-300},
                                     {"type": "text", "text": "What happens?"}]}]
try:
    prompt = proc.prepare_chat(chat)
    text = proc.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
    outcome, ok = f"a prompt of {len(prompt.token_ids)} tokens reading {text[text.find('<2'):][:60]!r}...", False
except VideoError as error:
    outcome, ok = f"a VideoError: {error}", "2**49" in str(error)
_common.verdict(ok, f"4 frames at fps=1e-300 are {outcome}", f"4 frames at fps=1e-300 are {outcome}")
