"""Session fixtures of the GPU tests: one random-weight Qwen3-VL-8B checkpoint (built on the GPU once,
~17 GB on disk) and HF's model of it, shared by every GPU test module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prism.testing.checkpoints import build_checkpoint
from prism.testing.gpu import release_gpu_memory

# Shared with the benchmarks (bench/*.py build the same checkpoint here): built once per machine.
SHARED_8B = Path("/tmp/prism-bench/qwen3vl-8b-random")


@pytest.fixture(scope="session")
def ckpt_8b():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if (SHARED_8B / "config.json").exists():
        return SHARED_8B
    return build_checkpoint("8b", SHARED_8B, device="cuda", progress=True)


@pytest.fixture(scope="session")
def hf_8b(ckpt_8b):
    from transformers import Qwen3VLForConditionalGeneration

    # No device_map: that needs `accelerate`, which the project does not depend on.
    hf = Qwen3VLForConditionalGeneration.from_pretrained(ckpt_8b, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.to("cuda").eval()
    hf.generation_config.eos_token_id = None  # compare every step
    return hf


@pytest.fixture(autouse=True)
def _free_engines_after_each_test():
    """Engines hold ~25 GB each (weights, KV pool, graph pools) and reference cycles (patched methods),
    so they outlive `del` until the garbage collector runs: run it, or the next test runs out of memory."""
    yield
    release_gpu_memory()
