"""Found by the review of session 33: ICO was an accepted image format, and Pillow decodes an icon's whole picture as
it opens it (`IcoImageFile._open` calls `load()`), so the size limits, per image and the request's pixel budget, read
"the header" of an ICO only after its pixels were decoded: a 258 KB icon wrapping a flat 9000x9000 PNG cost 1 s and
534 MB per look, before any limit saw its size. Fixed when ICO bytes are refused as not an accepted format."""

import io
import struct

import _common  # noqa: F401
from PIL import Image

from prism.media.errors import MediaDecodeError
from prism.media.image import header_size

SIDE = 2000  # a flat PNG: a few KB of bytes, 12 MB of pixels
png = io.BytesIO()
Image.new("RGB", (SIDE, SIDE), (200, 30, 30)).save(png, format="PNG")
png_bytes = png.getvalue()
# An icon directory of one entry (0 = 256 px, the PNG's own size wins) pointing at the PNG right after it.
ico = struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(png_bytes), 22) + png_bytes

try:
    size = header_size(ico)
except MediaDecodeError as error:
    _common.verdict(True, f"ICO bytes are refused before any pixel is decoded: {error}", "")
opened = Image.open(io.BytesIO(ico))
_common.verdict(False, "", f"an ICO of {len(ico)} bytes was accepted, its size {size} read by decoding its "
                f"{SIDE}x{SIDE} picture (Pillow opened it {'decoded' if opened._im is not None else 'undecoded'})")
