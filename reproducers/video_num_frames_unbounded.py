"""Found by the review of session 35: offline, a video's `num_frames` was used as given (HF's rule): 10**12 asked
numpy for 7.28 TiB of frame indices (a MemoryError), and 10**5 of 4 frames made a prompt of 450,019 tokens in 16 s
of CPU. Fixed when a count past the processor's `max_frames` (the most frames it samples a video to at any fps, 768 for
Qwen3-VL) is a `VideoError` naming that limit."""

import time

import _common
import numpy as np

from prism.engine.inputs import InputProcessor  # noqa: E402
from prism.media.errors import VideoError  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

proc = InputProcessor(ensure_tiny_checkpoint())
frames = [np.zeros((32, 32, 3), np.uint8)] * 4
results = []
for count in (10**12, 10**5):
    chat = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 2.0, "num_frames": count},
                                         {"type": "text", "text": "What happens?"}]}]
    start = time.perf_counter()
    try:
        prompt = proc.prepare_chat(chat)
        outcome, ok = f"a prompt of {len(prompt.token_ids)} tokens", False
    except VideoError as error:
        outcome, ok = f"a VideoError: {error}", "max_frames=" in str(error)
    except Exception as error:  # noqa: BLE001 - what the bug raised
        outcome, ok = f"{type(error).__name__}: {error}", False
    results.append((ok, f"num_frames={count}: {outcome} ({time.perf_counter() - start:.2f} s)"))
_common.verdict(all(ok for ok, _ in results), "; ".join(r for _, r in results), "; ".join(r for _, r in results))
