"""The logit adjustments on a CUDA device (the CPU suite runs them on the CPU only): the adjusted logits of a batch
mixing every knob are the CPU's, and an engine on the GPU (tiny checkpoint, CUDA graphs, async scheduling) gives a
greedy presence-penalized request the same tokens as async scheduling off, never repeating one."""

from __future__ import annotations

import pytest
import torch

from prism.engine.llm import LLM
from prism.engine.penalties import TokenHistory, adjusted_logits
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_adjusted_logits_on_the_gpu_are_the_cpus():
    torch.manual_seed(0)
    vocab = 151_936
    logits = torch.randn(4, vocab) * 4
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=1.5),
              SamplingParams(logit_bias={7: -100.0, 151_935: 5.0}),
              SamplingParams(),
              SamplingParams(presence_penalty=-1.0, logit_bias={3: 2.0})]
    histories = [TokenHistory([1, 2, 3, 151_935], [5, 5, 9]), None, None, TokenHistory([], [3, 3, 3, 4])]
    cpu = adjusted_logits(logits, params, histories)
    gpu = adjusted_logits(logits.cuda(), params, histories)
    torch.cuda.synchronize()
    assert torch.equal(gpu.cpu(), cpu)


def test_a_presence_penalized_greedy_request_never_repeats_on_the_gpu():
    ckpt = ensure_tiny_checkpoint()
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True, presence_penalty=2.0)
    prompts = ["Tell me a story about paged attention.", "Count to twenty please."]
    results = {}
    for async_scheduling in (True, False):
        llm = LLM(ckpt, device="cuda", kv_memory_bytes=2**28, async_scheduling=async_scheduling)
        try:
            results[async_scheduling] = [c.token_ids for c in llm.generate(prompts, [params, params])]
        finally:
            llm.engine.shutdown()
    assert results[True] == results[False]
    for tokens in results[True]:
        assert len(tokens) == 40 and len(set(tokens)) == 40, tokens
