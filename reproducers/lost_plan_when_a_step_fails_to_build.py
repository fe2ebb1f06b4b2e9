"""Found by review (session 27): the runner takes the step's transfer plan from the KV manager, then builds the step
(`ModelRunner.prepare`), then runs the plan's moves first thing in the run. A step that failed while it was built
never ran them, yet the manager already counted them done: a request preempted by swapping in that step (not one of
the step's requests, so not failed with it) held CPU pages that never received its KV, and resumed on zeros.

Here two requests outgrow a small pool with swap preemption; the first step whose plan swaps pages out fails while
it is built. The swapped-out request's CPU pages must then hold exactly the KV its GPU pages held, and it must
finish with the tokens it gets when no step fails."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable

from prism.testing import swapped_request as scenario


def fail_the_first_swapping_step_while_it_is_built(engine) -> list:
    runner, checks = engine.runner, []
    prepare = runner.prepare

    def fails_once_when_swapping(plan, slices, kv, *args, **kwargs):
        if plan.swap_out and not checks:
            pool = runner.gpu_pool
            gpu_pages = [g for g, _ in plan.swap_out]
            cpu_pages = [c for _, c in plan.swap_out]
            checks.append((cpu_pages, pool.payload[:, :, gpu_pages].clone(),
                           None if pool.scales is None else pool.scales[:, :, gpu_pages].clone()))
            raise RuntimeError("a planted failure while the step is built")
        return prepare(plan, slices, kv, *args, **kwargs)

    runner.prepare = fails_once_when_swapping
    return checks


undisturbed, _, _ = scenario.run(None)
disturbed, problem, checks = scenario.run(fail_the_first_swapping_step_while_it_is_built)
if not checks:
    raise SystemExit("BUG IN THE REPRODUCER: no step swapped pages out; make the pool smaller")
survivors, wrong = scenario.survivors_and_wrong(undisturbed, disturbed)
_common.verdict(
    problem is None and survivors and not wrong,
    f"the step failed, the request it swapped out kept its KV and finished as it does undisturbed ({survivors})",
    f"a swapped-out request after a step that failed to build: {problem or 'its tokens differ'} "
    f"(wrong tokens: {wrong}, survivors: {survivors})",
)
