"""TP2 over NCCL on two GPUs: greedy tokens of the TP2 engine equal the TP1 engine (fp32 weights, so the
reordered row-parallel sums cannot flip a greedy choice) on text, three images and a cached request, with
FP8 KV on each rank and CUDA-graph decode on each rank, with and without async scheduling under TP. Skipped without
two CUDA devices."""

from __future__ import annotations

import time

import pytest
import torch

from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

IMAGES = random_images([(64, 96), (96, 64), (64, 64)], seed=3)


def chat(*parts) -> list[dict]:
    content = [{"type": "image", "image": p} if not isinstance(p, str) else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("tp_async", [False, True], ids=["sync", "tensor_parallel_async_scheduling"])
def test_tp2_nccl_greedy_equals_tp1(tp_async):
    """With `tensor_parallel_async_scheduling` TP2 also launches steps on tokens rank 0 sampled on its device (the
    followers take them by an NCCL broadcast): its continuations and, with one seat, its steps scheduled ahead."""
    params = SamplingParams.greedy(max_tokens=12, ignore_eos=True)
    prompts = ["Tell me a story about paged attention.", chat(IMAGES[0], IMAGES[1], IMAGES[2], "Compare them.")]
    cached = [chat(IMAGES[0], IMAGES[1], IMAGES[2], "Which is the brightest?")]
    out = {}
    for tp in (1, 2):
        llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=tp, dtype="float32", kv_dtype="fp8", page_size=16,
                  num_gpu_pages=64, cuda_graphs=True, distributed_timeout_s=120,
                  tensor_parallel_async_scheduling=tp_async,
                  max_num_seqs=1 if tp_async else 16)  # one seat: the scheduler runs ahead of waiting requests too
        try:
            first = llm.generate(prompts, params)
            second = llm.generate(cached, params)
            graphs = llm.engine.runner.graphs
            out[tp] = ([c.token_ids for c in first + second], second[0].cached_tokens, graphs and graphs.replays,
                       llm.engine.stats.async_steps, llm.engine.stats.scheduled_ahead_steps)
        finally:
            # With the ranks' decode graphs holding NCCL all-reduces, this hung forever on two H200s until each
            # rank destroyed its graphs before leaving its group (`tp_workers.leave_group`).
            start = time.monotonic()
            left = llm.engine.shutdown()
            followers = llm.engine._followers
        assert left, "leaving the TP group did not finish in time"
        assert time.monotonic() - start < 60
        if followers is not None:
            assert [p.exitcode for p in followers.processes] == [0] * (tp - 1)
    assert out[2][0] == out[1][0]
    assert out[2][1] == out[1][1] > 0
    assert out[2][2], "TP2 decode steps must replay CUDA graphs"
    assert (out[2][3] > 0) == tp_async and out[1][3] > 0
    assert out[2][4] > 0 if tp_async else out[2][4] == 0
