"""Where every benchmark writes: bench/results/<date>-<gpu>[-<suffix>].json (raw numbers) and .md (the table)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(numbers: dict, table: str, gpu: str, date: str, suffix: str = "") -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"{date}-{gpu.replace(' ', '-').lower()}" + (f"-{suffix}" if suffix else "")
    (RESULTS / f"{stem}.json").write_text(json.dumps(numbers, indent=2))
    (RESULTS / f"{stem}.md").write_text(table)
    return RESULTS / f"{stem}.md"
