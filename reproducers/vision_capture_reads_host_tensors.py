"""The vision graphs' first version captured the whole encoder call, whose grid metadata (interpolation taps,
rotary cos / sin) is computed on the host and copied to the device: on the H200 every capture failed ("Cannot copy
between CPU and CUDA tensors during CUDA graph capture"), so the encoder always ran eagerly. The captured part
(`VisionEncoder.encode`) must read no host tensor; the metadata is made before the capture (`grid_metadata`).
Checked on the `meta` device (no GPU): the tiny checkpoint's encoder over two images."""

import _common
import torch  # noqa: E402

from prism.model.config import Qwen3VLConfig  # noqa: E402
from prism.model.vision import VisionEncoder  # noqa: E402
from prism.testing.checkpoints import checkpoint_config  # noqa: E402
from prism.testing.host_reads import host_tensor_reads  # noqa: E402

config = Qwen3VLConfig.from_dict(checkpoint_config("tiny")).vision
with torch.device("meta"):
    visual = VisionEncoder(config).to(torch.bfloat16)
grids = [(1, 4, 4), (1, 2, 4)]
meta = visual.grid_metadata(grids)
pixels = torch.zeros(sum(t * h * w for t, h, w in grids), config.patch_dim, device="meta", dtype=torch.bfloat16)
reads = host_tensor_reads(lambda: visual.encode(pixels, meta))
_common.verdict(
    not reads,
    "the captured encoder call reads no host tensor (its grid metadata is made before the capture)",
    f"the captured encoder call reads host tensors ({reads[:4]}): a CUDA graph capture of it fails",
)
