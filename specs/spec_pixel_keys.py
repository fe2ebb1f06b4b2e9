"""Spec of the preprocessing cache's key of images given as pixels (`media.digest.pixels_digest`).

The key is what a hot request's PIL images are found by, so it must be injective over the pixels: a PIL image
hashed in place (`media.pil_pixels`, four bytes a pixel) and an array hashed as it is must each get one key
per (shape, pixels), equal for equal pictures however they were made, and different for any other picture:
one channel of one pixel changed anywhere, or the same bytes in another shape.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from prism.media.digest import pixels_digest
from prism.media.pil_pixels import exported_rgbx


@st.composite
def pictures(draw: st.DrawFn) -> np.ndarray:
    h, w = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**32 - 1))
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@st.composite
def neighbours(draw: st.DrawFn, arr: np.ndarray) -> np.ndarray:
    """Another picture as close to `arr` as possible: one channel of one pixel flipped, or its bytes reshaped."""
    h, w, _ = arr.shape
    reshapes = [(a, (h * w) // a) for a in range(1, h * w + 1) if (h * w) % a == 0 and a != h]
    if reshapes and draw(st.booleans()):
        return arr.reshape(draw(st.sampled_from(reshapes)) + (3,))
    other = arr.copy()
    y, x, c = draw(st.integers(0, h - 1)), draw(st.integers(0, w - 1)), draw(st.integers(0, 2))
    other[y, x, c] ^= draw(st.integers(1, 255))
    return other


@settings(max_examples=150, deadline=None)
@given(data=st.data(), arr=pictures())
def spec_pixel_keys_identify_the_picture(data, arr) -> None:
    img = Image.fromarray(arr)
    rgbx = exported_rgbx(img)
    assert rgbx is not None and np.array_equal(rgbx[..., :3], arr), "the exported storage is not the pixels"
    remade = Image.fromarray(arr.copy()).convert("RGBA").convert("RGB")
    assert pixels_digest(img) == pixels_digest(remade), "one picture made two ways got two keys"
    wide = np.zeros((arr.shape[0], 2 * arr.shape[1], 3), dtype=np.uint8)
    wide[:, ::2] = arr
    assert pixels_digest(arr) == pixels_digest(wide[:, ::2]), "a strided view of the same pixels got another key"
    other = data.draw(neighbours(arr))
    assert pixels_digest(Image.fromarray(other)) != pixels_digest(img), \
        f"pictures {arr.shape} and {other.shape} differ but share a key"
    assert pixels_digest(other) != pixels_digest(arr), "arrays that differ share a key"
