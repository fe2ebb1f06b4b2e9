"""Found by specs/spec_scheduler_liveness.py: two running requests of equal priority (decision branches share
their material's arrival order) on a full pool; each needs a page, neither may preempt the other, and both
waited forever. Fixed when requests are totally ordered (arrival order, then creation order) so the older
one preempts the younger and both finish."""

import _common
from specs.spec_scheduler_liveness import FakePrompt  # noqa: E402

from prism.kv.content import MediaSpan  # noqa: E402

short = FakePrompt([1], ())
long = FakePrompt([1] + [9] * 7 + [2] * 6 + [9] * 9 + [3], (MediaSpan(1, 7, b"\x01" * 16), MediaSpan(14, 9, b"\x02" * 16)))
_common.liveness_verdict([(short, 6), (long, 5)], [0, 0], "both equal-arrival requests finished on an 8-page pool",
                         preemption="swap", pool_pages=8, budget=24)
