"""A PIL image's pixels read in place (`media.pil_pixels`) and the preprocessing key made of them
(`media.digest.pixels_digest`)."""

from __future__ import annotations

import gc
import io

import numpy as np
import pytest
import torch
from PIL import Image

from prism.engine.inputs import InputProcessor
from prism.media import digest as digest_mod
from prism.media import pil_pixels
from prism.media.digest import pixels_digest
from prism.media.pil_pixels import exported_rgbx, rgb0_frame
from prism.testing.checkpoints import ensure_tiny_checkpoint


@pytest.fixture(scope="module")
def proc():
    return InputProcessor(ensure_tiny_checkpoint(), cache_bytes=1 << 26)


def _pixels(h: int = 37, w: int = 53, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _encoded(img: Image.Image, fmt: str) -> Image.Image:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def _made_every_way(arr: np.ndarray) -> dict[str, Image.Image]:
    img = Image.fromarray(arr)
    return {
        "fromarray": img,
        "from RGBA": Image.fromarray(arr).convert("RGBA").convert("RGB"),
        "from L": Image.fromarray(arr[..., 0]).convert("RGB"),
        "from P": img.convert("P").convert("RGB"),
        "crop": img.crop((3, 2, 40, 30)),
        "resize": img.resize((20, 11), Image.Resampling.BICUBIC),
        "png": _encoded(img, "PNG"),
        "jpeg": _encoded(img, "JPEG"),
        "new": Image.new("RGB", (7, 5), (1, 2, 3)),
        "copy": img.copy(),
    }


@pytest.mark.parametrize("name", list(_made_every_way(_pixels())))
def test_the_exported_storage_is_the_pixels(name):
    img = _made_every_way(_pixels())[name]
    rgbx = exported_rgbx(img)
    assert rgbx is not None and rgbx.shape == (img.size[1], img.size[0], 4)
    np.testing.assert_array_equal(rgbx[..., :3], np.asarray(img))


def test_the_padding_byte_costs_a_miss_never_a_content_change(proc):
    """Pillow's resize leaves the padding byte 0 where decoding and conversions leave 255: the same picture
    then has two pixel keys (prepared twice), and one content digest."""
    resized = Image.fromarray(_pixels(seed=6)).resize((64, 32), Image.Resampling.BICUBIC)
    remade = Image.fromarray(np.asarray(resized))
    assert (exported_rgbx(resized)[..., 3] == 0).all() and (exported_rgbx(remade)[..., 3] == 255).all()
    assert pixels_digest(resized) != pixels_digest(remade)
    prompt = "<|vision_start|><|image_pad|><|vision_end|>?"
    assert proc.prepare_prompt(prompt, [resized]).media[0].digest == proc.prepare_prompt(prompt, [remade]).media[0].digest


def test_the_view_is_read_only_and_outlives_the_image():
    arr = _pixels(64, 48, seed=1)
    img = Image.fromarray(arr)
    rgbx = exported_rgbx(img)
    with pytest.raises(ValueError):
        rgbx[0, 0, 0] = 1
    del img
    gc.collect()
    others = [Image.fromarray(_pixels(64, 48, seed=s)) for s in range(2, 12)]  # reuse freed memory if it were
    np.testing.assert_array_equal(rgbx[..., :3], arr)
    assert len(others) == 10


def test_what_is_not_exported_in_one_piece_is_none():
    assert exported_rgbx(Image.fromarray(_pixels()[..., 0])) is None  # mode L
    assert exported_rgbx(Image.fromarray(_pixels()).convert("RGBA")) is None
    big = Image.new("RGB", (2100, 2100))  # 17.6 MB of storage: over one 16 MiB block, rows not contiguous
    assert exported_rgbx(big) is None


def test_pixel_keys_follow_the_pixels():
    arr = _pixels(seed=3)
    img = Image.fromarray(arr)
    assert pixels_digest(img) == pixels_digest(_encoded(img, "PNG")) == pixels_digest(img.copy())
    assert pixels_digest(arr) == pixels_digest(arr.copy())
    assert pixels_digest(img) != pixels_digest(arr)  # two layouts, two schemes: never one key by accident

    last = img.copy()
    r, g, b = last.getpixel((last.width - 1, last.height - 1))
    last.putpixel((last.width - 1, last.height - 1), (r, g, b ^ 1))  # the very last byte of the storage
    assert pixels_digest(last) != pixels_digest(img)

    flat = _pixels(6, 8, seed=4).reshape(-1)
    wide, tall = Image.fromarray(flat.reshape(6, 8, 3)), Image.fromarray(flat.reshape(8, 6, 3))
    assert pixels_digest(wide) != pixels_digest(tall)  # same bytes, another shape


def test_an_image_pillow_does_not_export_is_keyed_as_its_array(monkeypatch):
    img = Image.fromarray(_pixels(seed=5))
    exported = pixels_digest(img)
    monkeypatch.setattr(digest_mod, "exported_rgbx", lambda image: None)
    assert pixels_digest(img) == pixels_digest(np.asarray(img)) != exported


def test_padded_rows_are_never_read_as_pixels():
    """With a row alignment above 1 Pillow may pad rows; a W*H*4 buffer would then not be the image: refused."""
    old = Image.core.get_alignment()
    Image.core.set_alignment(64)
    try:
        arr = _pixels(5, 3, seed=7)  # 12-byte rows
        img = Image.fromarray(arr)
        assert exported_rgbx(img) is None
        assert pixels_digest(img) == pixels_digest(arr)  # keyed as its pixels copied, under the arrays' scheme
    finally:
        Image.core.set_alignment(old)


@pytest.mark.parametrize("name", list(_made_every_way(_pixels())))
def test_the_frame_is_the_pixels_and_a_zero_byte(name):
    """`rgb0_frame`: R, G, B and 0 per pixel whatever Pillow left in its padding byte (255, 0 or mixed), in new
    memory the caller owns."""
    img = _made_every_way(_pixels())[name]
    frame = rgb0_frame(img)
    assert frame.shape == (img.size[1], img.size[0], 4) and frame.dtype == np.uint8 and frame.flags.c_contiguous
    np.testing.assert_array_equal(frame[..., :3], np.asarray(img))
    assert not frame[..., 3].any()
    assert frame.flags.writeable and not np.shares_memory(frame, exported_rgbx(img))


def test_a_frame_from_an_array_or_an_unexported_image_is_the_same_bytes(monkeypatch):
    arr = _pixels(seed=8)
    img = Image.fromarray(arr).rotate(90, expand=True)  # padding byte left mixed by the rotation
    want = rgb0_frame(img)
    monkeypatch.setattr(pil_pixels, "exported_rgbx", lambda image: None)
    np.testing.assert_array_equal(rgb0_frame(img), want)
    np.testing.assert_array_equal(rgb0_frame(np.asarray(img)), want)
    with pytest.raises(ValueError, match="RGB"):
        rgb0_frame(arr[..., :2])


def test_an_image_leaves_pillow_without_tobytes(monkeypatch):
    """The frame is copied out of Pillow's exported storage (a ufunc that releases the GIL), not through
    `Image.tobytes`, which holds the GIL for the whole copy: the media threads then ran one at a time."""
    from prism.media.config import ImageProcessorConfig
    from prism.media.image import preprocess_image

    cfg = ImageProcessorConfig(patch_size=16, min_pixels=32 * 32, max_pixels=64 * 96, image_mean=(0.5, 0.5, 0.5),
                               image_std=(0.5, 0.5, 0.5))
    exact, resized = Image.fromarray(_pixels(64, 96, seed=9)), Image.fromarray(_pixels(70, 90, seed=10))
    want = [preprocess_image(im, cfg).pixels.normalized() for im in (exact, resized)]

    def no_tobytes(self, *args, **kwargs):
        raise AssertionError("Image.tobytes called on the preprocessing path")

    monkeypatch.setattr(Image.Image, "tobytes", no_tobytes)
    for im, values in zip((exact, resized), want, strict=True):
        assert torch.equal(preprocess_image(im, cfg).pixels.normalized(), values)
