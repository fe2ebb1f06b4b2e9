"""Found by review: every step, the penalties rebuilt each penalized row's counts from its whole output history on
the host (the output list made an array, range-checked, concatenated, every token copied to the device and
scatter_added into a fresh [rows, vocab] table): 32 rows at 8,192 output tokens cost ~5 ms of host time per step,
about an H200 batch-32 decode step, and the cost grows with the square of the generation's length (Qwen3-VL's model
card recommends presence_penalty=1.5, so every request may pay it). Fixed: each request's counts persist in a slot
of the engine's count table (`engine/penalty_counts.py`), given only the tokens appended since its last sample.

32 presence-penalized requests with 8,192 output tokens each get one more token and are sampled again: the int64
values that step copies to the device must be a few per row (its new token, its row), not its history, and the
logits must be those of counts rebuilt from scratch."""

from types import SimpleNamespace

import _common
import numpy as np  # noqa: E402
import torch  # noqa: E402

from prism.engine import penalties  # noqa: E402
from prism.engine.penalty_counts import PenaltyCounts  # noqa: E402
from prism.engine.request import FinishReason, Request  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.ops import host_copy  # noqa: E402

ROWS, LENGTH, VOCAB = 32, 8192, 1024
rng = np.random.default_rng(0)
params = [SamplingParams(presence_penalty=1.5, frequency_penalty=0.5)] * ROWS
requests = []
for i in range(ROWS):
    request = Request(f"r{i}", SimpleNamespace(token_ids=[1, 2]), params[i], i)
    request.output_token_ids.extend(rng.integers(VOCAB, size=LENGTH).tolist())
    requests.append(request)
logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0))
table = PenaltyCounts("cpu", VOCAB, slots=ROWS)  # an engine's, of max_num_seqs slots
penalties.adjusted_logits(logits, params, [r.token_history() for r in requests], table)  # the first sample fills them

copied: list[int] = []
to_device = host_copy.to_device


def counting(values, device, dtype=None):
    if dtype is torch.int64:
        copied.append(len(values))
    return to_device(values, device, dtype)


for r in requests:
    r.output_token_ids.append(int(rng.integers(VOCAB)))
host_copy.to_device = counting
try:
    got = penalties.adjusted_logits(logits, params, [r.token_history() for r in requests], table)
finally:
    host_copy.to_device = to_device
fresh = penalties.adjusted_logits(logits, params, [penalties.TokenHistory([1, 2], list(r.output_token_ids))
                                                   for r in requests])
for r in requests:
    r.finish(FinishReason.LENGTH)
_common.verdict(
    sum(copied) <= 2 * ROWS and torch.equal(got, fresh),
    f"a step of {ROWS} rows with {LENGTH:,} output tokens each copies {sum(copied)} int64 values to the device "
    "(each row's new token and its row), and adjusts the logits as counts rebuilt from scratch do",
    f"the step copied {sum(copied):,} int64 values to the device for {ROWS} rows with one new token each "
    f"(or its logits differ from a rebuild's: {not torch.equal(got, fresh)})",
)
