"""The eager vision encoder runs its attention by backends that need no per-shape plan (cuDNN's costs ~55 ms per
new shape on the H200), flash attention first; a captured encoder call (`VisionEncoder.encode`, what the vision
graphs capture) keeps PyTorch's choice; the caller's own backend settings win. Tiny checkpoint's encoder, CPU."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from prism.model import vision as vision_module
from prism.model.attention import plan_free_sdpa
from prism.model.config import Qwen3VLConfig
from prism.model.vision import VisionEncoder
from prism.testing.checkpoints import checkpoint_config
from prism.testing.sdpa_backends import sdpa_backends_per_call

GRIDS = [(1, 4, 4), (1, 2, 4)]


def encoder_and_pixels():
    config = Qwen3VLConfig.from_dict(checkpoint_config("tiny")).vision
    torch.manual_seed(0)
    visual = VisionEncoder(config).eval()
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), config.patch_dim)
    return visual, pixels


def test_eager_encoder_attention_is_flash_first_and_never_cudnn():
    visual, pixels = encoder_and_pixels()
    with torch.no_grad():
        calls = sdpa_backends_per_call(lambda: visual(pixels, GRIDS))
        assert len(calls) >= visual.cfg.depth and set(calls) == {(False, True)}
        # what a capture records keeps the default choice (cuDNN on Hopper: faster, its plan built at the capture)
        meta = visual.grid_metadata(GRIDS)
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert set(sdpa_backends_per_call(lambda: visual.encode(pixels, meta))) == {(True, True)}
        # and the same features either way on the CPU (one SDPA kernel there)
        assert torch.equal(visual(pixels, GRIDS).embeds, visual.encode(pixels, meta).embeds)
        assert torch.backends.cuda.cudnn_sdp_enabled(), "the flags are restored after the eager call"


def test_the_callers_backend_settings_win():
    visual, pixels = encoder_and_pixels()
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]):
        assert set(sdpa_backends_per_call(lambda: visual(pixels, GRIDS))) == {(False, False)}  # math only
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), plan_free_sdpa():  # nothing else enabled: left as it is
        assert torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.math_sdp_enabled()


def test_the_check_sees_an_eager_encoder_that_allows_cudnn(monkeypatch):
    """Planted: the eager encoder without the plan-free backends."""
    monkeypatch.setattr(vision_module, "plan_free_sdpa", nullcontext)
    visual, pixels = encoder_and_pixels()
    with torch.no_grad():
        calls = sdpa_backends_per_call(lambda: visual(pixels, GRIDS))
    assert calls and all(cudnn for cudnn, _ in calls)
