"""Found by review (session 28): an image larger than one step is downscaled to fit (session 27), but the budget's
smart resize rounds each side up: with `max_num_batched_tokens=50` a 100x100 image became 64 tokens and was refused
("too large for this server ... send it at most about 0.1 megapixels"), and a 32x6400 one at 100 tokens became 141.
Now whole factors come off the longer side until it fits (`media.image.target_size`)."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable

from prism.media.config import ImageProcessorConfig
from prism.media.image import target_size

QWEN3_VL = ImageProcessorConfig(patch_size=16, merge_size=2, min_pixels=65536, max_pixels=16777216,
                                image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
over = []
for (height, width), budget in (((100, 100), 50), ((64, 64), 20), ((32, 6400), 100)):
    h, w = target_size(height, width, QWEN3_VL.within_tokens(budget))
    if h * w // QWEN3_VL.factor**2 > budget:
        over.append(f"{height}x{width} at {budget} tokens -> {h}x{w} ({h * w // QWEN3_VL.factor**2} tokens)")
_common.verdict(not over, "every image fits a small step's budget", "; ".join(over))
