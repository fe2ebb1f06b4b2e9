"""Found by review (session 27): the runner takes the step's transfer plan from the KV manager, then builds the step
(`ModelRunner.prepare`), then runs the plan's moves first thing in the run. A step that failed while it was built
never ran them, yet the manager already counted them done: a request preempted by swapping in that step (not one of
the step's requests, so not failed with it) held CPU pages that never received its KV, and resumed on zeros.

Here two requests outgrow a small pool with swap preemption; the first step whose plan swaps pages out fails while
it is built. The swapped-out request's CPU pages must then hold exactly the KV its GPU pages held, and it must
finish with the tokens it gets when no step fails."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable
import torch

from prism.engine.config import EngineConfig
from prism.engine.engine import Engine
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint

PROMPTS = ["Tell me a long story about the sea.", "Count slowly from one to a hundred, please."]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def run(fail_a_swapping_step: bool) -> tuple[dict[str, list[int]], str | None]:
    torch.manual_seed(0)
    engine = Engine(ensure_tiny_checkpoint(), EngineConfig(page_size=4, num_gpu_pages=24, num_cpu_pages=32,
                                                           preemption="swap", max_num_seqs=2,
                                                           max_num_batched_tokens=64, check_invariants=True))
    runner, checks = engine.runner, []
    prepare = runner.prepare

    def fails_once_when_swapping(plan, slices, kv, *args, **kwargs):
        if fail_a_swapping_step and plan.swap_out and not checks:
            pool = runner.gpu_pool
            gpu_pages = [g for g, _ in plan.swap_out]
            cpu_pages = [c for _, c in plan.swap_out]
            checks.append((cpu_pages, pool.payload[:, :, gpu_pages].clone(),
                           None if pool.scales is None else pool.scales[:, :, gpu_pages].clone()))
            raise RuntimeError("a planted failure while the step is built")
        return prepare(plan, slices, kv, *args, **kwargs)

    runner.prepare = fails_once_when_swapping
    for i, text in enumerate(PROMPTS):
        engine.add_request(f"r{i}", [{"role": "user", "content": text}], GREEDY)
    tokens: dict[str, list[int]] = {}
    problem, checked = None, False
    for _ in range(500):
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.finished and event.error:
                tokens[event.request_id] = ["failed"]
        if checks and not checked:  # right after the failed step: before anything reuses the pages
            cpu_pages, payload, scales = checks[0]
            cpu = runner.cpu_pool
            same = torch.equal(cpu.payload[:, :, cpu_pages], payload) and (
                scales is None or torch.equal(cpu.scales[:, :, cpu_pages], scales))
            problem = None if same else "its CPU pages do not hold the KV its GPU pages held"
            checked = True
        if not engine.has_unfinished_requests():
            break
    if fail_a_swapping_step and not checks:
        raise SystemExit("BUG IN THE REPRODUCER: no step swapped pages out; make the pool smaller")
    return tokens, problem


undisturbed, _ = run(False)
disturbed, problem = run(True)
survivors = [r for r, t in disturbed.items() if t != ["failed"]]
wrong = [r for r in survivors if disturbed[r] != undisturbed[r]]
_common.verdict(
    problem is None and survivors and not wrong,
    f"the step failed, the request it swapped out kept its KV and finished as it does undisturbed ({survivors})",
    f"a swapped-out request after a step that failed to build: {problem or 'its tokens differ'} "
    f"(wrong tokens: {wrong}, survivors: {survivors})",
)
