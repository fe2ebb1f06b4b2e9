"""Found in review of encoding ahead: two cold image requests arriving together while another request decodes.
The first had its images encoded ahead, then was prefilled; in that same step the second had its images
encoded ahead, so the decoders waited for the vision encoder and a prefill in one step, which is what encoding
ahead exists to avoid. Fixed when encoding ahead waits for a step without a prefill."""

import _common
from specs.spec_scheduler_liveness import FakePrompt  # noqa: E402

from prism.kv.content import MediaSpan  # noqa: E402

DECODER = (FakePrompt([1, 2, 3], ()), 12)
COLD_A = (FakePrompt([1] + [9] * 6 + [2, 2], (MediaSpan(1, 6, b"\x01" * 16),)), 2)
COLD_B = (FakePrompt([1] + [9] * 6 + [3, 3], (MediaSpan(1, 6, b"\x02" * 16),)), 2)

_common.liveness_verdict([DECODER, COLD_A, COLD_B], [0, 3, 3],
                         "two cold requests beside a decoder: no step encoded ahead and prefilled at once",
                         preemption="recompute", pool_pages=16, budget=24, encode_ahead=True)
