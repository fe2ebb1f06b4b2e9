"""Shared by the reproducers: make `prism` importable from a checkout and report a verdict."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT / "src", ROOT):  # the package, and the specs whose harnesses some reproducers reuse
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def verdict(ok: bool, fixed: str, broken: str) -> None:
    if ok:
        print(f"OK: {fixed}")
        sys.exit(0)
    print(f"BUG: {broken}", file=sys.stderr)
    sys.exit(1)
