"""An image's frame was copied out of Pillow by `np.array(image)`, which goes through `Image.tobytes`: the copy
holds the GIL throughout, into a bytes object and again into the array. On the H200's host 8 new 448x448 images
took 10-15 ms to prepare on 8 media threads, no faster than on one (session 10). The frame must leave Pillow by a
copy that releases the GIL (`media.pil_pixels.rgb0_frame`: Pillow's exported storage masked by a NumPy ufunc).
Checked by refusing `Image.tobytes` while an image that needs no resize and one that does are preprocessed."""

import _common
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from prism.media.config import ImageProcessorConfig  # noqa: E402
from prism.media.image import preprocess_image  # noqa: E402

cfg = ImageProcessorConfig(patch_size=16, min_pixels=32 * 32, max_pixels=448 * 448, image_mean=(0.5, 0.5, 0.5),
                           image_std=(0.5, 0.5, 0.5))
rng = np.random.default_rng(0)
images = [Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8)) for size in ((448, 448, 3), (300, 500, 3))]
calls = []
real_tobytes = Image.Image.tobytes


def counted_tobytes(self, *args, **kwargs):
    calls.append(self.size)
    return real_tobytes(self, *args, **kwargs)


Image.Image.tobytes = counted_tobytes
for image in images:
    preprocess_image(image, cfg)
Image.Image.tobytes = real_tobytes
_common.verdict(
    not calls,
    "image frames leave Pillow without Image.tobytes (a copy that releases the GIL)",
    f"preprocessing copied {len(calls)} frame(s) through Image.tobytes, which holds the GIL: {calls}",
)
