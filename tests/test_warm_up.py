"""The warm-up at engine start (`engine/warm_up.py`) leaves nothing behind: no encoder-cache entry, no stats, no
changed KV byte. (Whether it compiles what the first requests would: `tests/gpu/test_engine_gpu.py`.)"""

from __future__ import annotations

import pytest
import torch

from prism.engine.llm import LLM
from prism.engine.warm_up import warm_up_first_uses
from prism.testing.checkpoints import ensure_tiny_checkpoint

pytestmark = pytest.mark.filterwarnings(
    # the Triton interpreter turns 1-element arrays into loop bounds; numpy deprecates that (not our code)
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")


def test_the_warm_up_leaves_no_state_behind():
    runner = LLM(ensure_tiny_checkpoint(), kv_dtype="fp8", page_size=8, num_gpu_pages=16).engine.runner
    pool = runner.gpu_pool
    payload, scales = pool.payload.clone(), pool.scales.clone()
    stats, cached = dict(vars(runner.stats)), len(runner.encoder_cache)
    warm_up_first_uses(runner.model, pool)  # on the CPU the Triton copy runs in the interpreter
    assert dict(vars(runner.stats)) == stats and len(runner.encoder_cache) == cached
    assert torch.equal(pool.payload.view(torch.uint8), payload.view(torch.uint8))
    assert torch.equal(pool.scales, scales)
