"""The 8B decoder's GEMMs at decode batch sizes against the copy bandwidth (not part of `nox -s bench`).

W3 batch 1 is ~4.0 ms of GEMMs against a 3.55 ms floor: cuBLAS streams gate/up near the copy bandwidth but QKV,
O and down at 73-85%. For each weight shape (bf16, [out, in]) and batch M this times, inside a CUDA graph of 20
calls: `F.linear` (what the model runs: cuBLASLt), and at M = 1 `torch.mv` (the cuBLAS GEMV path), printing
microseconds per call and the fraction of the measured copy bandwidth the weight read reaches. Consecutive calls
read different copies of the weight (at least 200 MB in all), so no call finds its weight in the L2 cache.

--gemv: instead, the batch-1 GEMV of `prism.ops.gemv` (each program streams BLOCK_N weight rows in BLOCK_K columns)
at M = 1 for QKV, O and down, its launch knobs swept, against `F.linear` (how its defaults were chosen).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from kernel_timing import copy_bandwidth, us_per_call_in_graph  # noqa: E402

from prism.ops import gemv as ops_gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}


def gemv(w: torch.Tensor, x: torch.Tensor, block_n: int, block_k: int, warps: int, stages: int) -> torch.Tensor:
    """`prism.ops.gemv.gemv` with these launch knobs (the module's own restored afterwards)."""
    saved = ops_gemv.BLOCK_N, ops_gemv.BLOCK_K, ops_gemv.NUM_WARPS, ops_gemv.NUM_STAGES
    ops_gemv.BLOCK_N, ops_gemv.BLOCK_K, ops_gemv.NUM_WARPS, ops_gemv.NUM_STAGES = block_n, block_k, warps, stages
    try:
        return ops_gemv.gemv(w, x)
    finally:
        ops_gemv.BLOCK_N, ops_gemv.BLOCK_K, ops_gemv.NUM_WARPS, ops_gemv.NUM_STAGES = saved


GEMV_KNOBS = {"block_n": (8, 16), "block_k": (512, 1024), "warps": (4, 8), "stages": (3,)}


def gemv_sweep(bandwidth: float) -> list[str]:
    lines = []
    for name in ("qkv", "o", "down"):
        n, k = SHAPES[name]
        copies = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
                  for _ in range(max(1, -(-200 * 2**20 // (n * k * 2))))]
        floor_us = n * k * 2 / bandwidth * 1e6
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        want = F.linear(x.float(), copies[0].float())[0]
        ws = itertools.cycle(copies)
        results = [(us_per_call_in_graph(lambda x=x, ws=ws: F.linear(x, next(ws))), "F.linear")]
        for values in itertools.product(*GEMV_KNOBS.values()):
            knobs = dict(zip(GEMV_KNOBS, values, strict=True))
            err = float((gemv(copies[0], x[0], **knobs).float() - want).abs().max())
            us = us_per_call_in_graph(lambda knobs=knobs, x=x, ws=ws: gemv(next(ws), x[0], **knobs))
            results.append((us, f"gemv {knobs} max err {err:.1e}"))
        for us, label in sorted(results):
            lines.append(f"{name:5s} {n:6d}x{k:5d} M= 1 {us:7.1f} us ({floor_us / us:4.0%} of the copy bandwidth)  {label}")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/decode_gemms.txt")
    parser.add_argument("--gemv", action="store_true", help="a Triton GEMV's knobs swept at M = 1 (see GEMV_KNOBS)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    lines = [f"copy bandwidth (read + write) {bandwidth / 1e12:.2f} TB/s"]
    if args.gemv:
        lines += gemv_sweep(bandwidth)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        return
    for name, (n, k) in SHAPES.items():
        copies = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
                  for _ in range(max(1, -(-200 * 2**20 // (n * k * 2))))]
        floor_us = n * k * 2 / bandwidth * 1e6
        for m in (1, 8, 32):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ws = itertools.cycle(copies)
            variants = {"F.linear": lambda x=x, ws=ws: F.linear(x, next(ws))}
            if m == 1:
                variants["torch.mv"] = lambda x=x, ws=ws: torch.mv(next(ws), x[0])
            for label, fn in variants.items():
                us = us_per_call_in_graph(fn)
                lines.append(f"{name:8s} {n:6d}x{k:5d} M={m:2d} {label:9s} {us:7.1f} us  floor {floor_us:6.1f} us "
                             f"({floor_us / us:4.0%} of the copy bandwidth)")
                print(lines[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
