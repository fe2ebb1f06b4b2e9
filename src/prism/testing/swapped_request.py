"""Two greedy requests that outgrow a small pool with swap preemption, one step of which fails: the scenario of the
checks that a request swapped out by a lost step keeps its KV (`reproducers/lost_plan_when_a_step_fails_to_build.py`,
`reproducers/plan_failed_partway_counted_as_run.py`). Owns no invariant."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.sampling import SamplingParams
from .checkpoints import ensure_tiny_checkpoint

PROMPTS = ["Tell me a long story about the sea.", "Count slowly from one to a hundred, please."]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
FAILED = ["failed"]  # the tokens of a request that failed


def run(plant: Callable[[Engine], list] | None) -> tuple[dict[str, list], str | None, list]:
    """Run PROMPTS to their ends on a fresh engine (page size 4, 24 GPU and 32 CPU pages, invariants checked), after
    `plant(engine)` has planted a failing step: it returns a list the failure appends, as it fires, the CPU pages
    the step swaps out and the payload and scales (None without) they must receive. Returns each request's tokens
    (FAILED for one that failed), what is wrong with those CPU pages right after the failed step (None: nothing) and
    the plant's list."""
    torch.manual_seed(0)
    engine = Engine(ensure_tiny_checkpoint(), EngineConfig(page_size=4, num_gpu_pages=24, num_cpu_pages=32,
                                                           preemption="swap", max_num_seqs=2,
                                                           max_num_batched_tokens=64, check_invariants=True))
    checks = plant(engine) if plant is not None else []
    for i, text in enumerate(PROMPTS):
        engine.add_request(f"r{i}", [{"role": "user", "content": text}], GREEDY)
    tokens: dict[str, list] = {}
    problem, checked = None, False
    for _ in range(500):
        for event in engine.step():
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.finished and event.error:
                tokens[event.request_id] = FAILED
        if checks and not checked:  # right after the failed step: before anything reuses the pages
            cpu_pages, payload, scales = checks[0]
            cpu = engine.runner.cpu_pool
            same = torch.equal(cpu.payload[:, :, cpu_pages], payload) and (
                scales is None or torch.equal(cpu.scales[:, :, cpu_pages], scales))
            problem = None if same else "its CPU pages do not hold the KV its GPU pages held"
            checked = True
        if not engine.has_unfinished_requests():
            break
    return tokens, problem, checks


def survivors_and_wrong(undisturbed: dict[str, list], disturbed: dict[str, list]) -> tuple[list[str], list[str]]:
    """The requests that did not fail in the disturbed run, and those of them whose tokens differ from undisturbed."""
    survivors = [r for r, t in disturbed.items() if t != FAILED]
    return survivors, [r for r in survivors if disturbed[r] != undisturbed[r]]
