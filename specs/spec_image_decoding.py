"""Spec of decoding a client's image bytes (`media.image.decode_image`): which bytes become pixels, and which pixels.

- Decoding never starts a process. Pillow's EPS decoder runs Ghostscript on the bytes; here Pillow is told that
  Ghostscript is installed and `subprocess.Popen` records (and refuses) whatever would start.
- Bytes in a format outside `ACCEPTED_FORMATS` are refused as `MediaDecodeError`, whatever Pillow could open.
- Bytes in an accepted format decode to the pixels HF's `load_image` makes of them (EXIF orientation, then RGB), and
  the formats clients send most (PNG, JPEG, WebP, GIF, BMP, TIFF) always decode.
"""

from __future__ import annotations

import io
import subprocess
import warnings
from unittest import mock

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import EpsImagePlugin, Image
from transformers.image_utils import load_image

from prism.media.errors import MediaDecodeError
from prism.media.image import ACCEPTED_FORMATS, decode_image

Image.init()
# Every format this Pillow writes: the accepted ones and the ones a client could send all the same.
WRITTEN = sorted(Image.SAVE)
COMMON = {"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"}
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n0 0 moveto 8 8 lineto stroke\nshowpage\n"


def _encoded(arr: np.ndarray, mode: str, fmt: str) -> bytes | None:
    """The picture written in `fmt` (None where Pillow cannot write this mode in it)."""
    img = Image.fromarray(arr)
    img = img if mode == "RGB" else img.convert(mode)
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():  # Pillow's deprecation notices of the formats it will drop
            warnings.simplefilter("ignore", DeprecationWarning)
            img.save(buf, format=fmt)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return buf.getvalue()


def _pillow_format(data: bytes) -> str | None:
    """The format Pillow (unrestricted, opening only the header) reads the bytes as."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with Image.open(io.BytesIO(data)) as img:
                return img.format
    except Exception:  # noqa: BLE001 - bytes Pillow cannot open at all
        return None


@settings(max_examples=120, deadline=None)
@given(
    h=st.integers(1, 20), w=st.integers(1, 20), seed=st.integers(0, 2**32 - 1),
    mode=st.sampled_from(["RGB", "RGBA", "L", "P"]), fmt=st.sampled_from(WRITTEN),
)
@example(h=8, w=8, seed=0, mode="RGB", fmt="EPS")
def spec_decoding_runs_no_program_and_decodes_as_hf(h, w, seed, mode, fmt) -> None:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    data = EPS if fmt == "EPS" else _encoded(arr, mode, fmt)
    if data is None:
        return
    started: list = []

    def record(args, *a, **k):
        started.append(args)
        raise OSError("no process may start while an image is decoded")

    with mock.patch.object(EpsImagePlugin, "gs_binary", "gs"), mock.patch.object(subprocess, "Popen", record):
        try:
            decoded = decode_image(data)
        except MediaDecodeError:
            decoded = None
    assert not started, f"decoding {fmt} bytes started {started}"
    opened_as = _pillow_format(data)
    if opened_as is not None and opened_as not in ACCEPTED_FORMATS and opened_as != "MPO":
        assert decoded is None, f"{opened_as} bytes (written as {fmt}) were decoded; accepted: {ACCEPTED_FORMATS}"
        return
    if fmt in COMMON:
        assert decoded is not None, f"{fmt} bytes of a {mode} picture were refused"
    if decoded is not None:
        expected = np.asarray(load_image(Image.open(io.BytesIO(data))))
        assert np.array_equal(np.asarray(decoded), expected), f"{fmt} bytes decode to other pixels than HF's"
