"""The eager vision encoder runs its attention by backends that need no per-shape plan (cuDNN's costs ~55 ms per
new shape on the H200); a captured encoder call (`VisionEncoder.encode`, what the vision graphs capture) keeps
PyTorch's choice. Tiny checkpoint's encoder, CPU."""

from __future__ import annotations

import torch

from prism.model import vision as vision_module
from prism.model.config import Qwen3VLConfig
from prism.model.vision import VisionEncoder
from prism.testing.checkpoints import checkpoint_config
from prism.testing.sdpa_backends import sdpa_calls_with_cudnn

GRIDS = [(1, 4, 4), (1, 2, 4)]


def encoder_and_pixels():
    config = Qwen3VLConfig.from_dict(checkpoint_config("tiny")).vision
    torch.manual_seed(0)
    visual = VisionEncoder(config).eval()
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), config.patch_dim)
    return visual, pixels


def test_eager_encoder_attention_never_allows_cudnn():
    visual, pixels = encoder_and_pixels()
    with torch.no_grad():
        calls, with_cudnn = sdpa_calls_with_cudnn(lambda: visual(pixels, GRIDS))
        assert calls >= visual.cfg.depth and with_cudnn == 0
        # what a capture records keeps the default choice (cuDNN on Hopper: faster, its plan built at the capture)
        meta = visual.grid_metadata(GRIDS)
        assert torch.backends.cuda.cudnn_sdp_enabled()
        calls, with_cudnn = sdpa_calls_with_cudnn(lambda: visual.encode(pixels, meta))
        assert with_cudnn == calls >= visual.cfg.depth
        # and the same features either way on the CPU (one SDPA kernel there)
        assert torch.equal(visual(pixels, GRIDS).embeds, visual.encode(pixels, meta).embeds)


def test_the_check_sees_an_eager_encoder_that_allows_cudnn(monkeypatch):
    """Planted: the eager encoder without the plan-free backends."""
    from contextlib import nullcontext

    monkeypatch.setattr(vision_module, "sdpa_kernel", lambda backends: nullcontext())
    visual, pixels = encoder_and_pixels()
    with torch.no_grad():
        calls, with_cudnn = sdpa_calls_with_cudnn(lambda: visual(pixels, GRIDS))
    assert with_cudnn == calls > 0
