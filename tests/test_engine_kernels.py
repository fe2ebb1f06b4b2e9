"""The engine's GPU code path on the CPU: `PRISM_KERNELS=triton` runs every Triton kernel (KV write, fused
norms / M-RoPE / SiLU-mul, paged prefill with a prefix hit, split-K decode) under the Triton interpreter inside
the real engine, and its greedy tokens and logprobs must match the torch references' (fp32, tiny checkpoint,
scaled-FP8 KV). Slow in the interpreter, so the prompts are short."""

from __future__ import annotations

import pytest
import torch

from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.ops.dispatch import KERNELS_ENV, kernels_override
from prism.ops.kv_write import HAVE_TRITON
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images

# The interpreter turns loop bounds loaded from tensors into ints through a NumPy conversion it deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

IMAGE = random_images([(32, 32)], seed=3)[0]
PARAMS = SamplingParams.greedy(max_tokens=3, ignore_eos=True, logprobs=2)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": text}]}]


def run(monkeypatch: pytest.MonkeyPatch, kernels: str, graph_rows: bool = False):
    monkeypatch.setenv(KERNELS_ENV, kernels)
    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), kv_dtype="fp8", page_size=8, num_gpu_pages=64, check_invariants=True,
              graph_rows_without_cuda=graph_rows)
    first = llm.generate([ask("Hi?"), "Kernels."], PARAMS)
    (hit,) = llm.generate([ask("Why?")], PARAMS)  # the image prefix is a cache hit: prefill over cached pages
    assert (llm.engine.runner.stats.graph_steps > 0) == graph_rows
    return [*first, hit]


@pytest.mark.skipif(torch.cuda.is_available() or not HAVE_TRITON, reason="the CPU interpreter run")
@pytest.mark.parametrize("graph_rows", [False, True], ids=["eager", "graphs"])
def test_engine_with_every_kernel_matches_the_references(monkeypatch, graph_rows):
    """graph-rows: decodes and the question after the hit run as the CUDA graphs' one-token rows through the
    decode kernel (eagerly: no graphs on the CPU)."""
    reference = run(monkeypatch, "reference")
    kernels = run(monkeypatch, "triton", graph_rows)
    assert kernels[-1].cached_tokens > 0, "the last request must hit the image prefix"
    for ref, ker in zip(reference, kernels, strict=True):
        assert ker.error is None, ker.error
        assert ker.token_ids == ref.token_ids and ker.cached_tokens == ref.cached_tokens
        for a, b in zip(ref.logprobs, ker.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) <= 1e-4, f"{ref.request_id}: kernels moved a logprob by {a.logprob - b.logprob}"


def test_kernels_override_is_validated(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "cuda-please")
    with pytest.raises(ValueError, match=KERNELS_ENV):
        kernels_override()
    monkeypatch.setenv(KERNELS_ENV, " Reference ")
    assert kernels_override() == "reference"
