"""Deterministic mode (issue 7) on the CPU: a fixed request's logits are bitwise identical alone or with
1, 3, 7 or 31 random companions, and whether its prefix was a cache hit or a miss. Every forward of the mode is
one tile through a packed bucket of one page (captured and replayed on CUDA, the same static buffers run eagerly
here); the GPU side is tests/gpu/."""

from __future__ import annotations

import random

import pytest
import torch

from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images

IMAGES = random_images([(160, 160), (96, 64), (64, 96)], seed=9)  # the first spans several pages
TARGET = [{"role": "user", "content": [{"type": "image", "image": IMAGES[0]},
                                       {"type": "text", "text": "What does the picture show, exactly?"}]}]
PARAMS = SamplingParams.greedy(max_tokens=6, ignore_eos=True)


def run_with(companions: int, *, deterministic: bool, warm: bool = False, seed: int = 0,
             warm_question: str = "What does the picture show, roughly?"):
    """The target's logits rows (one per generated token), next to `companions` random requests. `warm`: the
    same image was asked `warm_question` first."""
    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), kv_dtype="fp8", page_size=8, num_gpu_pages=512, max_num_seqs=64,
              deterministic=deterministic, check_invariants=True)
    engine = llm.engine
    if warm:  # the same image with another question: the target's image prefix becomes a cache hit
        llm.generate([[{"role": "user", "content": [{"type": "image", "image": IMAGES[0]},
                                                    {"type": "text", "text": warm_question}]}]], PARAMS)
    captured: list[torch.Tensor] = []
    execute = engine.runner.execute

    def capture(slices, kv, *rest):
        logits = execute(slices, kv, *rest)
        rows = [s for s in slices if s.sample]
        for row, s in enumerate(rows):
            if s.request.request_id == "target":
                captured.append(logits[row].clone())
        return logits

    engine.runner.execute = capture
    rng = random.Random(seed)
    for i in range(companions):
        parts = [{"type": "image", "image": IMAGES[rng.randrange(3)]}] if rng.random() < 0.5 else []
        parts.append({"type": "text", "text": " ".join(rng.choice(["red", "blue", "a", "cat", "why"]) for _ in range(rng.randint(1, 12)))})
        engine.add_request(f"c{i}", [{"role": "user", "content": parts}], SamplingParams(max_tokens=rng.randint(1, 9), temperature=0.0, ignore_eos=True))
    position = rng.randint(0, companions)  # the target may arrive anywhere among them
    if position == companions:
        engine.add_request("target", TARGET, PARAMS)
    out = None
    added = position == companions
    steps = 0
    while engine.has_unfinished_requests() or not added:
        if not added and steps == position:
            engine.add_request("target", TARGET, PARAMS)
            added = True
        for event in engine.step():
            if event.request_id == "target" and event.finished:
                out = event
        steps += 1
    assert out is not None
    stats = engine.runner.stats
    if deterministic:
        assert stats.packed_graph_steps == stats.steps > 0, "a deterministic forward left the tile bucket"
    return torch.stack(captured), out.cached_tokens


@pytest.fixture(scope="module")
def alone():
    return run_with(0, deterministic=True)


@pytest.mark.parametrize("companions", [1, 3, 7, 31])
def test_logits_do_not_depend_on_batch_companions(alone, companions):
    logits, _ = run_with(companions, deterministic=True, seed=companions)
    assert torch.equal(logits, alone[0]), f"logits changed with {companions} companions"


def test_hit_equals_miss_bitwise(alone):
    logits, cached = run_with(3, deterministic=True, warm=True, seed=5)
    assert cached > 0, "the target must have hit the cache"
    assert torch.equal(logits, alone[0]), "a cache hit changed the logits"


def test_a_hit_ending_inside_an_image_equals_a_miss_bitwise(alone):
    """The earlier prompt shares only the image (tokens 4-67 at 8-token pages), so the last whole shared page ends
    at 64, inside it: the hit stops there and the image's last rows take its features at an offset, in the tile a
    miss computes them in. (Walked back to a boundary outside images, as before session 12, nothing was reused.)"""
    logits, cached = run_with(3, deterministic=True, warm=True, seed=6, warm_question="Describe it.")
    assert cached == 64, f"the hit should end at the last whole page, inside the image (cached {cached})"
    assert torch.equal(logits, alone[0]), "a hit ending inside an image changed the logits"


def test_negative_control_default_mode(alone, record_property):
    """Default mode packs requests into one batch: report whether that changes bits on this machine."""
    default_alone, _ = run_with(0, deterministic=False)
    default_busy, _ = run_with(7, deterministic=False, seed=7)
    differs = not torch.equal(default_alone, default_busy)
    record_property("default_mode_logits_differ_with_companions_on_cpu", differs)
    print(f"default mode, CPU: logits {'differ' if differs else 'do not differ'} with 7 companions "
          f"(max abs diff {float((default_alone - default_busy).abs().max()):.3g})")
    assert torch.allclose(default_alone, default_busy, atol=1e-3), "default mode must still agree closely"
