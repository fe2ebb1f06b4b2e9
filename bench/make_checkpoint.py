"""Build the benchmarks' random-weight Qwen3-VL-8B-shaped checkpoint if it is not there (its own process).

`nox -s bench` runs this before the benchmarks, and `bench_engine.py` runs it as a subprocess when the checkpoint
is missing, so no measurement runs in the process that built 17.5 GB of weights: on a fresh H200 (session 11) the
first `bench_engine --quick` built it in-process and measured W1 at 81.5 ms with its engine part alternating
between ~57 and ~72 ms; the same code, rerun with the checkpoint on disk, measured 64.5 (engine part 58.3).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from prism.testing.checkpoints import build_checkpoint  # noqa: E402

DEFAULT = Path("/tmp/prism-bench/qwen3vl-8b-random")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, default=DEFAULT)
    args = parser.parse_args()
    if (args.ckpt / "config.json").exists():
        print(f"checkpoint present: {args.ckpt}")
        return
    import torch

    build_checkpoint("8b", args.ckpt, device="cuda" if torch.cuda.is_available() else "cpu", progress=True)


if __name__ == "__main__":
    main()
