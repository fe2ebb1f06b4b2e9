"""Liveness under load (REFERENCE §2, invariant 9): a 300-request randomized run on a tight KV pool with
random arrivals, cancels, chunked prefill, shared images and preemption. Every accepted request must
reach exactly one terminal event, no chunk may cut a visual span, the KV manager's accounting is
checked after every step, and no page is leaked at the end."""

from __future__ import annotations

import random

import pytest
import torch

from prism.engine.config import EngineConfig
from prism.engine.engine import Engine
from prism.engine.request import FinishReason
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_300_random_requests_all_terminate_without_leaks(preemption):
    torch.set_num_threads(1)
    rng = random.Random(1234 if preemption == "recompute" else 4321)
    config = EngineConfig(
        page_size=4,
        num_gpu_pages=72,  # 288 tokens: two or three image prompts at once
        num_cpu_pages=24 if preemption == "swap" else 0,
        preemption=preemption,
        max_num_seqs=6,
        max_num_batched_tokens=96,
        check_invariants=True,
    )
    engine = Engine(ensure_tiny_checkpoint(), config)
    images = random_images([(32, 32), (32, 64), (64, 32)], seed=7)
    questions = ["Describe it.", "Count the colours.", "Is it bright?", "What is missing?"]

    schedule = engine.scheduler.schedule

    def checked_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for s in out.slices:
            content = engine.scheduler.content_of(s.request)
            assert content.span_containing(s.end) is None, "a chunk cut a visual span"
        return out

    engine.scheduler.schedule = checked_schedule

    accepted: set[str] = set()
    terminal: dict[str, int] = {}
    live: list[str] = []
    next_id = 0
    steps = 0
    while next_id < 300 or engine.has_unfinished_requests():
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            if next_id == 300:
                break
            parts = [{"type": "image", "image": img} for img in rng.sample(images, rng.randint(0, 2))]
            parts.append({"type": "text", "text": rng.choice(questions)})
            params = SamplingParams(
                max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.8]), seed=rng.randint(0, 99)
            )
            request_id = f"r{next_id}"
            engine.add_request(request_id, [{"role": "user", "content": parts}], params)
            accepted.add(request_id)
            live.append(request_id)
            next_id += 1
        if live and rng.random() < 0.08:
            engine.abort(live.pop(rng.randrange(len(live))))
        for event in engine.step():
            if event.finished:
                terminal[event.request_id] = terminal.get(event.request_id, 0) + 1
                assert event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT), event.error
                if event.request_id in live:
                    live.remove(event.request_id)
        steps += 1
        assert steps < 5000, "the engine stopped making progress"

    assert set(terminal) == accepted, f"requests without a terminal event: {sorted(accepted - set(terminal))[:5]}"
    assert all(count == 1 for count in terminal.values()), "a request got two terminal events"
    kv = engine.kv
    assert not kv.seqs
    kv.clear_cache()
    kv.check_invariants()
    assert kv.gpu.num_free == kv.gpu.num_pages, "GPU pages leaked"
    assert kv.cpu.num_free == kv.cpu.num_pages, "CPU swap pages leaked"
    assert kv.stats.hit_tokens > 0, "shared images should have produced prefix hits"
    print(f"{preemption}: {steps} steps, {engine.stats.preemptions} preemptions, "
          f"{kv.stats.hit_tokens}/{kv.stats.queries_tokens} prompt tokens from the cache, "
          f"{kv.entries.evictions} evictions")
