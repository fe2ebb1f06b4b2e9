"""How fast can a decode step's linear layer stream its weight on this GPU? (An experiment, not part of `nox -s bench`.)

Per 8B weight shape, each call on another copy of the weight (none in L2), inside a CUDA graph of 20 calls:

- `read only`: a kernel that only reads the weight (each program sums its rows' tiles; no x): the stream rate a
  kernel of this size reaches with nothing else in its loop, in the engine's GEMV tiling;
- at one row (default): `gemv`, `prism.ops.gemv.gemv` at its defaults (what W3 batch 1 runs); `persistent`, the
  same product by (SMs x occupancy) programs each walking its row blocks and column tiles as one flat pipelined
  loop (a program's stream never drains between row blocks); `tma`, that loop with the weight tiles loaded by the
  tensor memory accelerator (a host tensor descriptor); `F.linear` (cuBLAS);
- at `--rows M` rows: `swap-AB`, a tensor-core GEMM with the weight's rows on the MMA's M side (64 or 128 of them,
  what Hopper's warpgroup MMA wants) and the step's rows on its N side, K split over programs for narrow layers;
  against `F.linear` and the read-only rate.

Each variant's result is checked against the fp32 product first.

Session 27 on the H200 (`bench/results/2026-12-02-nvidia-h200-session27-gemv-stream*.txt`): at one row the engine's
GEMV streams at the read-only rate of its size (gate/up 47.7 us = read only 47.7, 4.22 TB/s; down 24.5 vs 24.7; QKV
14.4 vs 14.1; O 10.2 vs 10.4) and neither the persistent nor the TMA loop beats it. QKV's and O's ~2.4 us over the
copy bandwidth is what a read of 48 or 32 MB costs in one kernel, not the GEMV's arithmetic. At 32 rows swap-AB
beats cuBLAS on every weight (gate/up without the activation 50.9 vs 51.6 us, QKV 15.5 vs 16.4, down 28.8 vs 29.6, O
11.6 vs 13.0) but not the engine's narrow-band skinny GEMM on O and down (11.5, 27.8 in session 19), and stays
~3 us over the read-only rate on gate/up.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@triton.jit
def _read_kernel(w_ptr, out_ptr, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        acc += tl.load(row_ptrs + (k0 + cols)[None, :]).to(tl.float32)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1))


@triton.jit
def _flat_gemv_kernel(w, x_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      NUM_STAGES: tl.constexpr, TMA: tl.constexpr):
    # A persistent GEMV: program p takes row blocks p, p + programs, ..., their column tiles as one flat pipelined
    # loop (the stream never drains between row blocks). TMA: `w` is a tensor descriptor, else a pointer.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    k_tiles = K // BLOCK_K
    my_blocks = (N // BLOCK_N - pid + nprog - 1) // nprog
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for t in tl.range(0, my_blocks * k_tiles, num_stages=NUM_STAGES):
        block = pid + (t // k_tiles) * nprog
        kt = t % k_tiles
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        if TMA:
            tile = w.load([block * BLOCK_N, kt * BLOCK_K])
        else:
            tile = tl.load(w + rows[:, None].to(tl.int64) * stride_w + (kt * BLOCK_K + cols)[None, :])
        x = tl.load(x_ptr + kt * BLOCK_K + cols).to(tl.float32)
        acc += tile.to(tl.float32) * x[None, :]
        if kt == k_tiles - 1:
            tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty))
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)


@triton.jit
def _swap_ab_kernel(w_ptr, x_ptr, y_ptr, M, N, K, K_PER_SPLIT, stride_w, stride_xm, BLOCK_W: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, SPLIT: tl.constexpr):
    # y^T [rows, m] = W[rows, :] . x^T: the weight's rows on the MMA's M side (64 or 128 of them, what Hopper's
    # warpgroup MMA wants), the step's few rows on its N side. SPLIT > 1: fp32 partials at y_ptr [SPLIT, M, N].
    rows = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    split = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    mmask = m < M
    k_lo = split * K_PER_SPLIT
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + k[None, :]
    x_ptrs = x_ptr + m[:, None] * stride_xm + k[None, :]
    acc = tl.zeros([BLOCK_W, BLOCK_M], tl.float32)
    for k0 in tl.range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_ptrs + k0)
        x = tl.load(x_ptrs + k0, mask=mmask[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    out = y_ptr + split.to(tl.int64) * M * N + m[None, :] * N + rows[:, None]
    if SPLIT == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mmask[None, :])
    else:
        tl.store(out, acc, mask=mmask[None, :])


def swap_ab_gemm(x, w, bw, bk, warps, stages, split):
    m, k = x.shape
    n = w.shape[0]
    assert n % bw == 0 and k % (bk * split) == 0
    block_m = max(16, triton.next_power_of_2(m))
    if split == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _swap_ab_kernel[(n // bw, split)](w, x, y, m, n, k, k // split, w.stride(0), x.stride(0), BLOCK_W=bw,
                                      BLOCK_M=block_m, BLOCK_K=bk, NUM_STAGES=stages, SPLIT=split, num_warps=warps)
    return y if split == 1 else y.sum(0).to(x.dtype)


def read_only(w, bn=8, bk=512, warps=4, stages=3):
    n, k = w.shape
    out = torch.empty(n, dtype=torch.float32, device=w.device)
    _read_kernel[(n // bn,)](w, out, k, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps)
    return out


def persistent_gemv(w, x, programs, bn, bk, warps, stages):
    n, k = w.shape
    assert n % bn == 0 and k % bk == 0
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _flat_gemv_kernel[(programs,)](w, x, y, n, k, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages,
                                   TMA=False, num_warps=warps)
    return y


_DESCRIPTORS: dict = {}


def tma_gemv(w, x, programs, bn, bk, warps, stages):
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, k = w.shape
    assert n % bn == 0 and k % bk == 0
    key = (w.data_ptr(), bn, bk)
    if key not in _DESCRIPTORS:  # made once per weight, as an engine would at load time
        _DESCRIPTORS[key] = TensorDescriptor.from_tensor(w, [bn, bk])
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _flat_gemv_kernel[(programs,)](_DESCRIPTORS[key], x, y, n, k, 0, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages,
                                   TMA=True, num_warps=warps)
    return y


def sweep_weight(name: str, rows: int, sms: int, bandwidth: float, quick: bool) -> list[str]:
    """The report's lines for one weight: every variant timed over copies of a random weight of its shape."""
    from kernel_timing import us_per_call_in_graph

    from prism.ops import gemv as ops_gemv

    n, k = SHAPES[name]
    copies = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
              for _ in range(max(2, -(-256 * 2**20 // (n * k * 2))))]
    x = torch.randn(k, dtype=torch.bfloat16, device="cuda") if rows == 1 else \
        torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    want = x.float() @ copies[0].float().T
    nbytes = n * k * 2
    results: list[tuple[float, str]] = []

    def timed(label, call, check=None):
        try:
            if check is not None:
                err = float((check(copies[0]).float() - want).abs().max())
                if err > 0.05:
                    results.append((float("inf"), f"{label}: WRONG, max err {err:.3g}"))
                    return
            ws = itertools.cycle(copies)
            us = us_per_call_in_graph(lambda: call(next(ws)))
        except Exception as error:  # a configuration the compiler refuses
            results.append((float("inf"), f"{label}: {type(error).__name__}: {str(error)[:120]}"))
            return
        results.append((us, label))

    timed("F.linear (cuBLAS)", lambda w: F.linear(x, w), lambda w: F.linear(x, w))
    for bn, bk, warps, stages in itertools.product((8, 16), (512, 1024), (4, 8), (3, 4)):
        timed(f"read only {bn}x{bk} w{warps} s{stages}", lambda w, a=(bn, bk, warps, stages): read_only(w, *a))
    if rows > 1:
        splits = (1,) if name in ("gate_up", "qkv") else (1, 2, 4)
        for bw, bk, warps, stages, split in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4), splits):
            a = (bw, bk, warps, stages, split)
            timed(f"swap-AB M={rows} {bw}x{bk} w{warps} s{stages} split {split}",
                  lambda w, a=a: swap_ab_gemm(x, w, *a), lambda w, a=a: swap_ab_gemm(x, w, *a))
        # the two best read-only rates, then the best others, and the first refusals
        results.sort(key=lambda r: r[0])
        shown = [r for r in results if r[1].startswith("read only")][:2]
        shown += [r for r in results if not r[1].startswith("read only")][:12]
        refused = [r for r in results if r[0] == float("inf")][:4]
        results = sorted(shown, key=lambda r: r[0]) + refused
    else:
        timed("gemv (engine defaults)", lambda w: ops_gemv.gemv(w, x), lambda w: ops_gemv.gemv(w, x))
        persistent_knobs = itertools.product((1, 2, 4), (8, 16), (512,), (4, 8), (4,) if quick else (3, 5))
        for occ, bn, bk, warps, stages in persistent_knobs:
            a = (sms * occ, bn, bk, warps, stages)
            timed(f"persistent {occ}/SM {bn}x{bk} w{warps} s{stages}", lambda w, a=a: persistent_gemv(w, x, *a),
                  lambda w, a=a: persistent_gemv(w, x, *a))
        tma_knobs = (itertools.product((1, 2), (16, 32), (256,), (4,), (4, 6)) if quick
                     else itertools.product((1, 2, 4), (16, 32, 64), (256,), (4, 8), (4, 6)))
        for occ, bn, bk, warps, stages in tma_knobs:
            a = (sms * occ, bn, bk, warps, stages)
            timed(f"tma {occ}/SM {bn}x{bk} w{warps} s{stages}", lambda w, a=a: tma_gemv(w, x, *a),
                  lambda w, a=a: tma_gemv(w, x, *a))
        results.sort(key=lambda r: r[0])
    lines = [f"== {name} {n}x{k}{f' M={rows}' if rows > 1 else ''} ({nbytes / 2**20:.1f} MiB; at the copy "
             f"bandwidth {nbytes / bandwidth * 1e6:.1f} us)"]
    for us, label in results:
        rate = f"{nbytes / us / 1e6:5.2f} TB/s" if us != float("inf") else "       -   "
        lines.append(f"  {us:7.2f} us  {rate}  {label}")
    return lines


def main() -> None:
    from kernel_timing import copy_bandwidth

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/gemv_stream.txt")
    parser.add_argument("--weights", default="gate_up,down,qkv,o")
    parser.add_argument("--quick", action="store_true", help="a few configurations of each variant")
    parser.add_argument("--rows", type=int, default=1, help="rows of x: above 1, the swap-AB tensor-core GEMM "
                        "against cuBLAS and the read-only rate instead of the GEMV variants")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth = copy_bandwidth()
    lines = [f"{torch.cuda.get_device_name()}: {sms} SMs, copy bandwidth (read + write) {bandwidth / 1e12:.2f} TB/s"]
    print(lines[-1], flush=True)
    for name in args.weights.split(","):
        report = sweep_weight(name, args.rows, sms, bandwidth, args.quick)
        torch.cuda.empty_cache()
        print("\n".join(report), flush=True)
        lines += report
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
