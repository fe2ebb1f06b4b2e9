"""Found by review (session 32): a lost step's plan is run on from the stage that did not finish
(`lost_steps.settle_the_plan`). When those moves failed again (a failure that repeats, as an out-of-memory or a bad
index would), the error escaped `Engine.step`, and the request the plan swapped out (not one of the step's) stayed
live on CPU pages that never received its KV: a caller that kept stepping resumed it on them. Now the requests whose
pages the unrun moves write fail with the error, and the engine goes on.

Here two requests outgrow a small pool with swap preemption and every swap-out raises before it moves anything."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable

from prism.kv import transfers
from prism.testing import swapped_request as scenario

swap_pages = transfers.swap_pages


def every_swap_out_fails(engine) -> list:
    runner = engine.runner

    def fails_when_swapping_out(src, dst, src_pages, dst_pages):
        if src is runner.gpu_pool:
            raise RuntimeError("a planted swap-out failure that repeats")
        return swap_pages(src, dst, src_pages, dst_pages)

    transfers.swap_pages = fails_when_swapping_out
    return []  # no pages to check: the requests they would hold must fail


undisturbed, _, _ = scenario.run(None)
escaped = None
try:
    disturbed, _, _ = scenario.run(every_swap_out_fails)
except RuntimeError as error:
    escaped = error
finally:
    transfers.swap_pages = swap_pages
if escaped is not None:
    _common.verdict(False, "", f"the repeated failure escaped Engine.step: {escaped}")
survivors, wrong = scenario.survivors_and_wrong(undisturbed, disturbed)
failed = sorted(set(disturbed) - set(survivors))
if not failed:
    raise SystemExit("BUG IN THE REPRODUCER: no request failed; no step swapped pages out")
_common.verdict(
    not wrong and set(disturbed) == set(undisturbed),
    f"every swap-out failed; the requests they moved failed ({failed}), the rest finished as undisturbed "
    f"({survivors}), and Engine.step raised nothing",
    f"requests resumed on pages that never received their KV: wrong tokens {wrong}",
)
