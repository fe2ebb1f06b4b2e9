"""Found by the media bug hunt: a client's image bytes were opened in any format Pillow knows, and Pillow decodes
EPS by running Ghostscript (`gs`, looked up on PATH) on them: a data URL made the server run a PostScript
interpreter on the client's program. Fixed when EPS bytes are refused as not an accepted image format and no
program starts; here a stand-in `gs` on PATH records every run."""

import os
import stat
import tempfile
from pathlib import Path

import _common  # noqa: F401
from PIL import EpsImagePlugin

from prism.media.errors import MediaDecodeError
from prism.media.image import decode_image

EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n0 0 moveto 10 10 lineto stroke\nshowpage\n"

with tempfile.TemporaryDirectory() as tmp:
    runs = Path(tmp) / "runs"
    gs = Path(tmp) / "gs"
    gs.write_text(f'#!/bin/sh\necho "$@" >> {runs}\nexit 0\n')
    gs.chmod(gs.stat().st_mode | stat.S_IXUSR)
    os.environ["PATH"] = f"{tmp}{os.pathsep}{os.environ.get('PATH', '')}"
    EpsImagePlugin.gs_binary = None  # Pillow looks for Ghostscript again, on this PATH
    try:
        decode_image(EPS)
        outcome = "decoded"
    except MediaDecodeError as error:
        outcome = f"refused: {error}"
    ran = runs.read_text().splitlines() if runs.exists() else []

_common.verdict(
    not ran and "accepted" in outcome,
    f"EPS bytes are {outcome}; no program ran",
    f"decoding EPS bytes ran `gs` {len(ran)} time(s) ({ran[-1] if ran else ''}); outcome: {outcome}",
)
