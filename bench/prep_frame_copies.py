"""How an image's frame could leave Pillow on this host: serial per image, and 8 images on 8 threads (not part of
`nox -s bench`; CPU only, a few seconds).

W1's preparation of 8 new 448x448 PIL images runs on 8 media threads but took as long as one thread on the H200's
host (10-15 ms; session 10): the frame is copied out of Pillow by `np.array(image)`, whose `tobytes` holds the GIL,
into fresh pages. This compares that copy with copies that release the GIL, from the pixel storage Pillow exports
(`media/pil_pixels.exported_rgbx`, 4 bytes a pixel): numpy's strided copy of the 3 colour bytes, a contiguous
copy of all 4, and the contiguous copy with the padding byte zeroed (`rgb0_frame`, the frame kept since). Each copy writes
fresh memory, as the preprocessing cache's frames do.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from prism.media.pil_pixels import exported_rgbx, rgb0_frame  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402


def pillow_copy(image):
    return np.array(image, dtype=np.uint8, order="C")


def strided_rgb_copy(image):
    rgbx = exported_rgbx(image)
    out = np.empty(rgbx.shape[:2] + (3,), dtype=np.uint8)
    np.copyto(out, rgbx[..., :3])
    return out


def rgbx_copy(image):
    return exported_rgbx(image).copy()


def rgb0_copy(image):
    """What preprocessing keeps now: the contiguous RGBX copy with the padding byte zeroed in the same pass."""
    return rgb0_frame(image)


def main() -> None:
    images = iter(random_images([(448, 448)] * 400, seed=11))
    kept = []  # the copies stay alive, as cached frames do: every copy writes fresh pages
    with ThreadPoolExecutor(8) as pool:
        for name, copy in (("np.array(image)", pillow_copy), ("strided RGB from the export", strided_rgb_copy),
                           ("contiguous RGBX from the export", rgbx_copy),
                           ("RGBX, padding zeroed (bitwise and)", rgb0_copy)):
            serial, threaded = [], []
            for _ in range(5):
                batch = [next(images) for _ in range(8)]
                start = time.perf_counter()
                kept.extend(copy(im) for im in batch)
                serial.append((time.perf_counter() - start) / 8)
                batch = [next(images) for _ in range(8)]
                start = time.perf_counter()
                kept.extend(pool.map(copy, batch))
                threaded.append(time.perf_counter() - start)
            print(f"{name:34s} serial {sorted(serial)[2] * 1e3:6.3f} ms per image | 8 images on 8 threads "
                  f"{sorted(threaded)[2] * 1e3:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
