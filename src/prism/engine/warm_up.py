"""Warm-up at engine start: owns *the first requests pay no JIT compile for kernels whose variant does not depend on
the request*.

Triton compiles a kernel's variant on its first launch (hundreds of ms each on a fresh machine, tens with its disk
cache). The decoder's graphs compile theirs while they are captured and `compile_attention_variants` the attention
splits; what remained for the first requests (W5 on the H200, session 15: 4 kernels, 0.66 s inside the first steps,
the first W5 run of a process at 53-54 req/s against 104-106 for the second) was the vision encoder's eager path
(its layer norm and rotary kernels) and the page-row copy of tail reuses. Their variants depend on the model's
widths and the pool's layout only (the copy's index rows are padded so that their alignment, which Triton also
specializes on, does not vary with the count), so one dummy launch of each at start compiles them for every
request. Shape-dependent first uses (cuDNN's attention plan per image size, a vision graph per grid list) are not
covered.
"""

from __future__ import annotations

import torch

from ..distributed.encoder_dp import encode_media_items
from ..distributed.tensor_parallel import TPGroup
from ..kv.fp8 import KVPool
from ..model.qwen3_vl import Qwen3VLModel
from ..ops.page_copy import copy_page_rows


def warm_up_first_uses(model: Qwen3VLModel, pool: KVPool) -> None:
    """Launch once what the first requests would otherwise compile: the vision encoder, eagerly, over a dummy
    image of 2x2 merged patches (this rank alone: no collective; nothing cached, no stats counted), and the Triton
    page-row copy of one row from page 0 to page 1. Call before any sequence holds a page: both are still the
    zeros the pool was allocated with, so the copy changes no byte."""
    vision = model.config.vision
    side = 2 * vision.spatial_merge_size
    patches = torch.zeros(side * side, vision.patch_dim, dtype=torch.float32)
    encode_media_items(model, [(1, side, side)], [patches], TPGroup.single(model.device))
    if pool.layout.num_pages >= 2:
        copy_page_rows(pool, [0], [1], [1], use_triton=True)
