"""The vision encoder's attention went to PyTorch's default SDPA backend, cuDNN on Hopper, which builds an execution
plan for every new shape: 54-59 ms on the H200 for [n images, 16 heads, 784 patches, 72] against ~0.2 ms for flash
attention's first call (session 10). Every new image count or size in a request paid it in the step, beside the
running decodes (W4 with the images encoded one per step: steps of 61-131 ms). The eager encoder must run its
attention with cuDNN's disabled (`model.attention.plan_free_sdpa`). Checked on the CPU: the flags are global."""

import _common
import torch  # noqa: E402

from prism.model.config import Qwen3VLConfig  # noqa: E402
from prism.model.vision import VisionEncoder  # noqa: E402
from prism.testing.checkpoints import checkpoint_config  # noqa: E402
from prism.testing.sdpa_backends import sdpa_backends_per_call  # noqa: E402

config = Qwen3VLConfig.from_dict(checkpoint_config("tiny")).vision
visual = VisionEncoder(config).eval()
grids = [(1, 4, 4), (1, 2, 4)]
pixels = torch.randn(sum(t * h * w for t, h, w in grids), config.patch_dim)
with torch.no_grad():
    calls = sdpa_backends_per_call(lambda: visual(pixels, grids))
with_cudnn = sum(cudnn for cudnn, _ in calls)
_common.verdict(
    bool(calls) and with_cudnn == 0,
    f"the eager vision encoder's {len(calls)} attention calls ran with cuDNN's per-shape plans disabled",
    f"{with_cudnn} of the eager vision encoder's {len(calls)} attention calls allowed cuDNN (a plan per new shape)",
)
