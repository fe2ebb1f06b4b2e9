"""Found by review (session 31): a step's transfer plan was marked run (`TransferPlan.executed`) before its first
move. A step whose plan raised partway (its swap-ins done, its swap-outs not) was then settled as if the whole plan
had run: the request it swapped out, not one of the step's and so not failed with it, resumed from CPU pages that
never received its KV. Fixed in session 32: `execute_plan` counts the stages that ran to their end
(`TransferPlan.stages_run`) and a lost step's plan runs on from the first that did not.

Here two requests outgrow a small pool with swap preemption; the first plan that swaps pages out moves half of them,
then raises. The swapped-out request's CPU pages must then hold the KV its GPU pages held, and it must finish with
the tokens it gets when no step fails."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable

from prism.kv import transfers
from prism.testing import swapped_request as scenario

swap_pages = transfers.swap_pages


def fail_halfway_through_the_first_swap_out(engine) -> list:
    runner, checks = engine.runner, []

    def swaps_half_then_fails(src, dst, src_pages, dst_pages):
        if src is runner.gpu_pool and not checks and len(src_pages) >= 2:
            checks.append((dst_pages.tolist(), src.payload[:, :, src_pages].clone(),
                           None if src.scales is None else src.scales[:, :, src_pages].clone()))
            half = len(src_pages) // 2
            swap_pages(src, dst, src_pages[:half], dst_pages[:half])
            raise RuntimeError("a planted failure halfway through the plan's swap-outs")
        return swap_pages(src, dst, src_pages, dst_pages)

    transfers.swap_pages = swaps_half_then_fails
    return checks


undisturbed, _, _ = scenario.run(None)
try:
    disturbed, problem, checks = scenario.run(fail_halfway_through_the_first_swap_out)
finally:
    transfers.swap_pages = swap_pages
if not checks:
    raise SystemExit("BUG IN THE REPRODUCER: no plan swapped two pages out; make the pool smaller")
survivors, wrong = scenario.survivors_and_wrong(undisturbed, disturbed)
_common.verdict(
    problem is None and survivors and not wrong,
    f"the plan failed halfway through its {len(checks[0][0])} swap-outs; the request it swapped out kept its KV and "
    f"finished as it does undisturbed ({survivors})",
    f"a swapped-out request after its plan failed partway: {problem or 'its tokens differ'} "
    f"(wrong tokens: {wrong}, survivors: {survivors})",
)
