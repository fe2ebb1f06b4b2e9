"""Found by specs/spec_scheduler_liveness.py: a prompt whose cached prefix ends inside a page was admitted
only with its hit, which pins the hit's pages and the tail page's source while a private tail copy is
allocated: on a tight pool that needs one page more than admitting the prompt cold, and with nothing else
running the prompt waited forever. Fixed when a lone admission falls back to reusing whole pages only,
then nothing."""

import _common
from specs.spec_scheduler_liveness import HIT_NEEDS_MORE_THAN_COLD  # noqa: E402

_common.liveness_verdict(*HIT_NEEDS_MORE_THAN_COLD, "the 29-token prompt was admitted on an 8-page pool after a "
                         "15-token hit", preemption="recompute", pool_pages=8, budget=14)
