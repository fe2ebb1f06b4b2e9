"""Deterministic mode on the H200 with the 8B-shaped checkpoint: a fixed request's logits are bitwise
identical alone, next to companions, and on a cache hit; the default mode (packed batches, CUDA graphs)
is the negative control and its difference is reported."""

from __future__ import annotations

import pytest
import torch

from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.testing.gpu import release_gpu_memory
from prism.testing.hf_reference import random_images

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

IMAGE = random_images([(448, 448)], seed=12)[0]
PARAMS = SamplingParams.greedy(max_tokens=4, ignore_eos=True)


def message(image, text):
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def target_logits(ckpt, *, deterministic: bool, companions: int, warm: bool) -> torch.Tensor:
    llm = LLM(ckpt, kv_memory_bytes=8 * 2**30, page_size=64, deterministic=deterministic)
    engine = llm.engine
    if warm:
        llm.generate([message(IMAGE, "What does the picture show, roughly? Give a long answer.")], PARAMS)
    captured = []
    execute = engine.runner.execute

    def capture(slices, kv, *rest):
        logits = execute(slices, kv, *rest)
        for row, s in enumerate([s for s in slices if s.sample]):
            if s.request.request_id == "target":
                captured.append(logits[row].clone())
        return logits

    engine.runner.execute = capture
    others = random_images([(224, 224)] * companions, seed=40)
    for i, image in enumerate(others):
        engine.add_request(f"c{i}", message(image, f"Companion {i} asks something."),
                           SamplingParams.greedy(max_tokens=1 + i % 4))
    engine.add_request("target", message(IMAGE, "What does the picture show, exactly? Give a long answer."), PARAMS)
    while engine.has_unfinished_requests():
        engine.step()
    out = torch.stack(captured).cpu()
    del llm, engine
    release_gpu_memory()
    return out


@pytest.fixture(scope="module")
def alone(ckpt_8b):
    return target_logits(ckpt_8b, deterministic=True, companions=0, warm=False)


@pytest.mark.parametrize("companions", [1, 3, 7, 31])
def test_deterministic_logits_ignore_companions_on_gpu(ckpt_8b, alone, companions):
    busy = target_logits(ckpt_8b, deterministic=True, companions=companions, warm=False)
    assert torch.equal(alone, busy), f"deterministic mode: {companions} companions changed the logits"


def test_deterministic_hit_equals_miss_and_default_mode_differs_on_gpu(ckpt_8b, alone):
    hit = target_logits(ckpt_8b, deterministic=True, companions=1, warm=True)
    assert torch.equal(alone, hit), "deterministic mode: a cache hit changed the logits"
    default_alone = target_logits(ckpt_8b, deterministic=False, companions=0, warm=False)
    default_busy = target_logits(ckpt_8b, deterministic=False, companions=3, warm=True)
    diff = float((default_alone - default_busy).abs().max())
    print(f"negative control, default mode on {torch.cuda.get_device_name()}: "
          f"{'differs' if diff else 'identical'} (max abs logit diff {diff:.4g})")


def test_deterministic_mode_replays_its_tiles_and_vision_with_the_eager_bits_on_gpu(ckpt_8b):
    """The mode's speed (session 25): every forward is a tile replayed from the page bucket's CUDA graph, and a
    grid list seen again replays a vision graph captured with the eager call's attention backend, whose features
    are the eager call's bits (else an image's features would depend on whether its size was seen before)."""
    llm = LLM(ckpt_8b, kv_memory_bytes=8 * 2**30, page_size=64, deterministic=True)
    runner = llm.engine.runner
    assert runner.packed is not None and runner.packed.buckets == (64,) and 64 in runner.packed._graphs
    llm.generate([message(IMAGE, "Describe the picture.")], PARAMS)
    assert runner.stats.packed_graph_steps == runner.stats.steps > 0 and runner.packed.replays == runner.stats.steps
    graphs, model = runner.vision_graphs, runner.model
    assert graphs is not None
    grid = (1, 20, 20)  # a size nothing above encoded
    g = torch.Generator(device=model.device).manual_seed(3)
    for trial in range(2):
        pixels = torch.randn(400, model.config.vision.patch_dim, device=model.device, dtype=model.dtype, generator=g)
        eager = model.encode_media(pixels, [list(grid)])
        outs = [graphs.encode(pixels, [grid]) for _ in range(graphs.capture_after + 1)]
        assert grid in [k[0] for k in graphs._graphs], "the grid list was not captured"
        for out in outs:
            assert torch.equal(out.embeds, eager.embeds) and torch.equal(out.deepstack, eager.deepstack), (
                f"trial {trial}: a vision replay in deterministic mode changed the features")
    del llm, runner, graphs, model
    release_gpu_memory()
