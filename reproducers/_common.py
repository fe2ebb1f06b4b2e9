"""Shared by the reproducers: make `prism` importable from a checkout and report a verdict."""

from __future__ import annotations

import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


def verdict(ok: bool, fixed: str, broken: str) -> None:
    if ok:
        print(f"OK: {fixed}")
        sys.exit(0)
    print(f"BUG: {broken}", file=sys.stderr)
    sys.exit(1)
