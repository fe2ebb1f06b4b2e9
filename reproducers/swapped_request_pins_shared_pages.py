"""Found by specs/spec_scheduler_liveness.py: swap-out moves only a sequence's private pages, so a swapped
request still holds the GPU pages it shares with the prefix cache. An older request that needed those
pages preempted it (freeing nothing), it was swapped back in, preempted again: both waited forever. Fixed
when, with no running request left to preempt, the youngest swapped request holding GPU pages is dropped
to recompute."""

import _common
from specs.spec_scheduler_liveness import SWAPPED_PINS_SHARED_PAGES  # noqa: E402

_common.liveness_verdict(*SWAPPED_PINS_SHARED_PAGES, "all five requests finished on a 9-page pool with swapping",
                         preemption="swap", pool_pages=9, budget=12)
