"""Found by review (session 22): a decide question's temperature only had to be > 0, and the readout divided the
candidates' logits by it first, so 1e-45 sent them to inf and the softmax made NaN (then the server's JSON
encoder failed: a plain-text 500). Fixed when the best logit is subtracted before the division (in fp64): a tiny
temperature gives the argmax."""

import math

import _common  # noqa: F401
import torch  # noqa: E402

from prism.decision.questions import readout  # noqa: E402

probs = readout(torch.tensor([0.5, 2.0, 1.0], dtype=torch.bfloat16), [0, 1, 2], 1e-45)
_common.verdict(all(math.isfinite(p) for p in probs) and probs == [0.0, 1.0, 0.0],
                f"temperature 1e-45 reads {probs}", f"temperature 1e-45 reads {probs}")
