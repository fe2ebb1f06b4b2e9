"""The pixels of a PIL image as a NumPy array without copying them (Pillow's Arrow export).

Owns: reading a PIL image's pixels on the hot path. `np.asarray(image)` goes through `Image.tobytes`, which
encodes the image into a new bytes object in 64 KiB pieces and joins them, holding the GIL throughout: on the
H200's host that was 0.33 ms per 448x448 image, 2.6 ms of the 5.5 ms that preparing W2's eight already-seen
images took, and the media threads could not overlap it. Pillow (11.2 and later) exports its own pixel
storage through the Arrow C data interface instead; this module maps that storage into a read-only array.

Layout: Pillow stores an RGB pixel in four bytes (R, G, B and a padding byte: 255 after decoding and most
conversions, 0 after a resize, mixed after a rotation), so `exported_rgbx` is [H, W, 4]. The preprocessing cache
keys PIL images by these bytes (`digest.pixels_digest`); the padding byte only ever costs a miss, never a wrong
hit, since the RGB bytes are all in the key. Rows must follow each other without padding: only with Pillow's
default row alignment of 1 (older Pillows exported aligned rows as if they were not padded).

Lifetime: the array's buffer holds the Arrow array capsule, whose release (when the last view goes away)
gives Pillow back its reference to the pixel storage, so a view stays valid after the image object is gone.

The frame an image is kept as (`rgb0_frame`) is the same layout with the padding byte zeroed: a contiguous copy
out of that storage, masked by a NumPy ufunc, so it runs without the GIL (the media threads copy in parallel)
and writes each byte once. `np.asarray(image)` copied under the GIL into a bytes object and again into the
array: on the H200's host 8 new 448x448 images took as long on 8 threads as on one (session 10).

Where Pillow cannot export (an older Pillow, a row alignment above 1, or an image larger than one of Pillow's
allocation blocks, 16 MiB by default, whose rows are not contiguous) `exported_rgbx` returns None and the caller copies with
`np.asarray` (`pixels_digest` then keys the copy under the scheme of arrays; `rgb0_frame` pads it).
"""

from __future__ import annotations

import ctypes

import numpy as np
from PIL import Image


class _ArrowSchema(ctypes.Structure):
    pass


_ArrowSchema._fields_ = [
    ("format", ctypes.c_char_p),
    ("name", ctypes.c_char_p),
    ("metadata", ctypes.c_char_p),
    ("flags", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowSchema))),
    ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]


class _ArrowArray(ctypes.Structure):
    pass


_ArrowArray._fields_ = [
    ("length", ctypes.c_int64),
    ("null_count", ctypes.c_int64),
    ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
    ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

# The Arrow type Pillow exports a multiband image as: a fixed-size list of 4 uint8 per pixel.
_RGBX_FORMAT, _BYTE_FORMAT = b"+w:4", b"C"


def _row_alignment() -> int:
    """Pillow's row alignment (`PILLOW_ALIGNMENT`, `Image.core.set_alignment`); unknown counts as unaligned."""
    get = getattr(Image.core, "get_alignment", None)
    return int(get()) if get is not None else 0


def exported_rgbx(image: Image.Image) -> np.ndarray | None:
    """The pixel storage of an RGB PIL image, read-only uint8 [H, W, 4] (the 4th byte is padding), without a
    copy; None where Pillow does not export it in one piece (see the module docstring)."""
    if image.mode != "RGB" or not hasattr(image, "__arrow_c_array__") or _row_alignment() != 1:
        return None  # with an alignment above 1 rows may be padded: a W*H*4 buffer would not be the image
    try:
        schema_capsule, array_capsule = image.__arrow_c_array__()
    except ValueError:  # "Image rows are not contiguous in memory": an image over several blocks
        return None
    schema = _ArrowSchema.from_address(_capsule_pointer(schema_capsule, b"arrow_schema"))
    array = _ArrowArray.from_address(_capsule_pointer(array_capsule, b"arrow_array"))
    width, height = image.size
    if (schema.format != _RGBX_FORMAT or schema.n_children != 1
            or schema.children[0].contents.format != _BYTE_FORMAT
            or array.length != width * height or array.offset or array.n_children != 1):
        return None  # a layout this module does not know: copy instead of guessing
    values = array.children[0].contents
    if values.length != 4 * width * height or values.offset or values.n_buffers != 2 or not values.buffers[1]:
        return None
    buffer = (ctypes.c_uint8 * values.length).from_address(values.buffers[1])
    buffer._keep_alive = array_capsule  # the storage stays Pillow's until every view of it is gone
    pixels = np.frombuffer(buffer, dtype=np.uint8).reshape(height, width, 4)
    pixels.flags.writeable = False
    return pixels


# R, G and B kept, the padding byte zeroed: one uint32 per pixel, the same mask in either byte order.
_RGB0_MASK = np.frombuffer(bytes((255, 255, 255, 0)), dtype=np.uint32)[0]


def rgb0_frame(image: Image.Image | np.ndarray) -> np.ndarray:
    """A new uint8 [H, W, 4] array of an RGB PIL image's or a uint8 [H, W, 3] array's pixels: R, G, B and a zero
    byte per pixel. From Pillow's own storage in one pass without the GIL where it exports it, else padded from
    `np.asarray` (the bytes are the same either way)."""
    rgbx = exported_rgbx(image) if isinstance(image, Image.Image) else None
    if rgbx is not None:
        out = np.empty(rgbx.shape, dtype=np.uint8)
        np.bitwise_and(rgbx.view(np.uint32), _RGB0_MASK, out=out.view(np.uint32))
        return out
    rgb = np.asarray(image, dtype=np.uint8)
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected RGB pixels [H, W, 3], got {list(rgb.shape)}")
    out = np.zeros(rgb.shape[:2] + (4,), dtype=np.uint8)
    out[..., :3] = rgb
    return out
