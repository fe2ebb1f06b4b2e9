"""The 8B decoder's GEMMs at decode batch sizes against the copy bandwidth (not part of `nox -s bench`).

W3 batch 1 is ~4.0 ms of GEMMs against a 3.55 ms floor: cuBLAS streams gate/up near the copy bandwidth but QKV,
O and down at 73-85%. For each weight shape (bf16, [out, in]) and batch M this times, inside a CUDA graph of 20
calls: `F.linear` (what the model runs: cuBLASLt), and at M = 1 `torch.mv` (the cuBLAS GEMV path), printing
microseconds per call and the fraction of the measured copy bandwidth the weight read reaches. Consecutive calls
read different copies of the weight (at least 200 MB in all), so no call finds its weight in the L2 cache.

--gemv: instead, the batch-1 GEMV of `prism.ops.gemv` (each program streams BLOCK_N weight rows in BLOCK_K columns)
at M = 1 for QKV, O and down, and its gate/up GEMV with the activation fused, their launch knobs swept with and
without programmatic dependent launch, against `F.linear` (how their defaults were chosen).

--skinny: the few-rows GEMM of `prism.ops.skinny_gemm` (tensor cores, each program streaming whole weight rows) at
M = 8, 32 and 64 (decode batches; 64: W2's packed question step; `--rows`, `--weights` to narrow it), its knobs
swept, against `F.linear` (how its defaults and its row range were chosen).

--chain: a residual add + RMSNorm, then a GEMV of its output, as in a decode layer, launched in order or early
(`prism.ops.pdl`). (Session 16 also tried an L2 prefetch of each program's first weight columns before its wait:
slower at every size, 1024-4096 columns, so it is gone; `-session16-chain.txt`.)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from kernel_timing import copy_bandwidth, module_knobs, us_per_call_in_graph  # noqa: E402

from prism.ops import gemv as ops_gemv  # noqa: E402
from prism.ops import skinny_gemm as ops_skinny  # noqa: E402
from prism.ops.fused_norms import add_rms_norm, silu_and_mul, silu_and_mul_reference  # noqa: E402
from prism.ops.pdl import programmatic_launch  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}


def gemv(w: torch.Tensor, x: torch.Tensor, block_n: int, block_k: int, warps: int, stages: int,
         silu: bool = False) -> torch.Tensor:
    """`prism.ops.gemv.gemv` (`silu`: `gemv_silu_and_mul`, block_n its outputs per program) with these launch
    knobs (the module's own restored afterwards)."""
    names = ("SILU_BLOCK_N", "SILU_BLOCK_K") if silu else ("BLOCK_N", "BLOCK_K")
    names += ("NUM_WARPS", "NUM_STAGES")
    with module_knobs(ops_gemv, dict(zip(names, (block_n, block_k, warps, stages), strict=True))):
        return ops_gemv.gemv_silu_and_mul(w, x) if silu else ops_gemv.gemv(w, x)


def gemv_of_weight(w: torch.Tensor, x: torch.Tensor, knobs: dict, silu: bool) -> torch.Tensor:
    return gemv(w, x, **knobs, silu=silu)


def weight_copies(name: str, bandwidth: float) -> tuple[int, int, list[torch.Tensor], float]:
    """(N, K, copies of a random [N, K] bf16 weight filling at least 200 MB, so that no call finds its weight in
    L2, and the read's floor in microseconds at `bandwidth`) for the 8B's weight `name`."""
    n, k = SHAPES[name]
    copies = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
              for _ in range(max(1, -(-200 * 2**20 // (n * k * 2))))]
    return n, k, copies, n * k * 2 / bandwidth * 1e6


def over_copies(copies: list[torch.Tensor], call) -> float:
    """Microseconds per `call(weight)` in a CUDA graph, each call on the next copy of the weight."""
    ws = itertools.cycle(copies)
    return us_per_call_in_graph(lambda: call(next(ws)))


def cublas_baseline(copies: list[torch.Tensor], x: torch.Tensor, silu: bool) -> tuple[torch.Tensor, list]:
    """(the exact product [M, N] in fp32, [(us, label)] of `F.linear` over the copies): what the engine runs without
    a Triton kernel (`silu`: gate/up, F.linear + silu_and_mul, and the activation applied to the product)."""
    want = F.linear(x.float(), copies[0].float())
    if silu:
        us = over_copies(copies, lambda w: silu_and_mul(F.linear(x, w)))
        return silu_and_mul_reference(want), [(us, "F.linear + silu_and_mul")]
    return want, [(over_copies(copies, functools.partial(F.linear, x)), "F.linear")]


def ranked(name: str, n: int, k: int, m: int, floor_us: float, results: list) -> list[str]:
    """The report's lines for one weight and row count, fastest first (printed as they are made)."""
    lines = []
    for us, label in sorted(results):
        lines.append(f"{name:7s} {n:6d}x{k:5d} M={m:2d} {us:7.1f} us ({floor_us / us:4.0%} of the copy bandwidth)  "
                     f"{label}")
        print(lines[-1], flush=True)
    return lines


GEMV_KNOBS = {"block_n": (4, 8, 16), "block_k": (512, 1024), "warps": (4,), "stages": (3,)}


def gemv_sweep(bandwidth: float) -> list[str]:
    """Each knob set timed with and without programmatic dependent launch: the graph's 20 calls then overlap
    each call's launch with the previous call's end (`prism.ops.pdl`)."""
    lines = []
    for name in ("qkv", "o", "down", "gate_up"):
        silu = name == "gate_up"  # the MLP's gate/up GEMV with the activation fused (`gemv_silu_and_mul`)
        n, k, copies, floor_us = weight_copies(name, bandwidth)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        want, results = cublas_baseline(copies, x, silu)
        want = want[0]
        for values in itertools.product(*GEMV_KNOBS.values()):
            knobs = dict(zip(GEMV_KNOBS, values, strict=True))
            err = float((gemv(copies[0], x[0], **knobs, silu=silu).float() - want).abs().max())
            for early in (False, True):
                with programmatic_launch(early):
                    us = over_copies(copies, functools.partial(gemv_of_weight, x=x[0], knobs=knobs, silu=silu))
                results.append((us, f"{'silu ' if silu else ''}gemv {knobs} pdl {early} max err {err:.1e}"))
        lines += ranked(name, n, k, 1, floor_us, results)
    return lines


def chain_sweep(bandwidth: float) -> list[str]:
    """The decode layer's pattern: a residual add + RMSNorm (one block, latency-bound: the memory bus idle) then a
    GEMV of its output, 20 pairs in a graph, launched in order or early. Microseconds per pair."""
    lines = []
    for name in ("qkv", "o", "down", "gate_up"):
        silu = name == "gate_up"
        n, k, copies, floor_us = weight_copies(name, bandwidth)
        x, r = (torch.randn(1, k, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        norm_w = torch.ones(k, dtype=torch.bfloat16, device="cuda")

        def pair(w, x=x, r=r, norm_w=norm_w, silu=silu):
            normed, _ = add_rms_norm(x, r, norm_w, 1e-6)
            return ops_gemv.gemv_silu_and_mul(w, normed[0]) if silu else ops_gemv.gemv(w, normed[0])

        for early in (False, True):
            with programmatic_launch(early):
                us = over_copies(copies, pair)
            lines.append(f"{name:7s} norm + {'silu ' if silu else ''}gemv {n:6d}x{k:5d} {us:7.1f} us per pair "
                         f"(the GEMV's floor {floor_us:5.1f} us)  {'launched early' if early else 'in order'}")
            print(lines[-1], flush=True)
    return lines


# Session 19's sweeps at 24 and 32 rows (`-session19-decode-gemms-skinny-split.txt`, `-narrow.txt`): 64 x 256 tiles,
# 4 warps and 2 splits win O and down (`skinny_gemm.NARROW_*`); QKV and gate/up keep cuBLAS; adding the partials in
# the GEMM's last program per tile lost at 32 rows. SPLIT_K sets the narrow band's splits too (`NARROW_SPLIT_K`), so
# it rules at every row count swept.
SKINNY_KNOBS = {"BLOCK_N": (64, 128), "BLOCK_K": (128, 256), "NUM_STAGES": (4,), "NUM_WARPS": (4,),
                "SPLIT_K": (1, 2, 3, 4)}


def skinny_sweep(bandwidth: float, rows: tuple[int, ...] = (8, 32, 64), out: Path | None = None,
                 names: tuple[str, ...] = ("qkv", "o", "down", "gate_up")) -> list[str]:
    """`prism.ops.skinny_gemm` at a few rows against `F.linear` (gate/up: with the activation, against F.linear +
    silu_and_mul), its launch knobs swept, all launched early (PDL) as in the engine's graphs. A knob set the
    compiler refuses (shared memory) is reported and skipped; the report so far is written to `out` after each
    weight and row count, so a call cut short keeps what it measured."""
    lines = []
    for name in names:
        silu = name == "gate_up"
        n, k, copies, floor_us = weight_copies(name, bandwidth)
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            with programmatic_launch(True):
                want, results = cublas_baseline(copies, x, silu)
            kernel = ops_skinny.skinny_gemm_silu_and_mul if silu else ops_skinny.skinny_gemm
            for values in itertools.product(*SKINNY_KNOBS.values()):
                knobs = dict(zip(SKINNY_KNOBS, values, strict=True))
                # gate/up's tiles are knobs of their own (SILU_BLOCK_N, SILU_BLOCK_K)
                module_values = {f"SILU_{key}" if silu and key.startswith("BLOCK") else key: value
                                 for key, value in knobs.items()}
                module_values["NARROW_SPLIT_K"] = knobs["SPLIT_K"]
                try:
                    with module_knobs(ops_skinny, module_values), programmatic_launch(True):
                        err = float((kernel(x, copies[0]).float() - want).abs().max())
                        us = over_copies(copies, lambda w, x=x, kernel=kernel: kernel(x, w))
                except Exception as error:  # a configuration the compiler refuses (shared memory...)
                    lines.append(f"{name:7s} M={m:2d} skinny {knobs}: {type(error).__name__}")
                    print(lines[-1], flush=True)
                    continue
                results.append((us, f"skinny {knobs} max err {err:.1e}"))
            lines += ranked(name, n, k, m, floor_us, results)
            if out is not None:
                out.write_text("\n".join(lines) + "\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/decode_gemms.txt")
    parser.add_argument("--gemv", action="store_true", help="a Triton GEMV's knobs swept at M = 1 (see GEMV_KNOBS)")
    parser.add_argument("--chain", action="store_true", help="norm + GEMV pairs, launched early or not")
    parser.add_argument("--skinny", action="store_true", help="the few-rows Triton GEMM's knobs swept at M = 8, "
                        "32 and 64 (see SKINNY_KNOBS)")
    parser.add_argument("--rows", default="8,32,64", help="--skinny: the row counts")
    parser.add_argument("--weights", default="qkv,o,down,gate_up", help="--skinny: the weights")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    lines = [f"copy bandwidth (read + write) {bandwidth / 1e12:.2f} TB/s"]
    if args.gemv or args.chain or args.skinny:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        if args.skinny:
            lines += skinny_sweep(bandwidth, tuple(int(r) for r in args.rows.split(",")), Path(args.out),
                                  tuple(args.weights.split(",")))
        else:
            lines += chain_sweep(bandwidth) if args.chain else gemv_sweep(bandwidth)
        Path(args.out).write_text("\n".join(lines) + "\n")
        return
    for name in SHAPES:
        n, k, copies, floor_us = weight_copies(name, bandwidth)
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
