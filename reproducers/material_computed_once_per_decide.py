"""Found on the H200 (session 23, `bench/profile_decide.py`): W7's 32 decides over 4 materials of 8 images, submitted
together, were admitted in the same steps and each computed its ~1,600-token material: every material 8 times (1.05 s
of the burst's 1.4 s of kernels were GEMMs; 17.5 decides/s). Fixed when a waiting request whose prompt shares at
least `defer_shared_prefill_tokens` (default 512) uncached tokens with a running prefill waits for it and hits its
pages. Here the scheduler's step loop (the liveness spec's) runs 8 requests over 2 materials of 1,600 tokens at the
engine's default threshold."""

import _common
from specs.spec_scheduler_liveness import FakePrompt, run  # noqa: E402

from prism.engine.config import EngineConfig  # noqa: E402
from prism.kv.content import MediaSpan  # noqa: E402


def prompt(material: int, question: int) -> FakePrompt:
    image = MediaSpan(1, 1568, bytes([material + 1]) * 16)  # 8 images of 196 tokens, as one span
    return FakePrompt([50 + material] + [9] * 1568 + [1] * 31 + [100 + question, 2, 3], (image,))


requests = [(prompt(q % 2, q), 1) for q in range(8)]
threshold = getattr(EngineConfig(), "defer_shared_prefill_tokens", None)
stats = run(requests, [0] * 8, {}, "recompute", pool_pages=8192, budget=16384, defer=threshold, max_num_seqs=16)
once = 2 * 1600 + 8 * 3
computed = stats["prompt_tokens_computed"]
_common.verdict(computed <= once + 8 * 4, f"{computed} prompt tokens computed for 8 requests over 2 materials "
                f"(each material once: {once})", f"{computed} prompt tokens computed; each material once is {once}")
