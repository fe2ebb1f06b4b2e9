"""Host time of cuBLAS's first call at a new row count (H200; not part of `nox -s bench`).

An eager prefill step runs the decoder's GEMMs at its own row count. This measures `F.linear` of the 8B's four
decoder shapes (QKV, O, gate/up, down) on the host: at row counts the process has not used yet, the same call
again, and its device time; then, after a sweep of every `--sweep-step`-th row count up to 2,048 (what a warm-up
at start could do), first calls at row counts the sweep skipped, and the LM head at a few rows. Session 21 (NOTES):
a first call costs ~0.1-0.3 ms of host when cuBLAS picks a kernel the process has used, ~2.5-5 ms when it picks
one it has not; again ~0.02-0.1 ms."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
VOCAB, HIDDEN, MAX_ROWS = 151936, 4096, 2048


def host_us(x: torch.Tensor, weight: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    F.linear(x, weight)
    us = (time.perf_counter() - t) * 1e6
    torch.cuda.synchronize()
    return us


def device_us(x: torch.Tensor, weight: torch.Tensor, reps: int = 10) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        F.linear(x, weight)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep-step", type=int, default=8)
    args = parser.parse_args()
    dev = torch.device("cuda")
    weights = {name: torch.randn(n, k, device=dev, dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}
    head = torch.randn(VOCAB, HIDDEN, device=dev, dtype=torch.bfloat16)
    flat = torch.zeros(MAX_ROWS * max(k for _, k in SHAPES.values()), device=dev, dtype=torch.bfloat16)

    def rows_of(m: int, k: int) -> torch.Tensor:  # contiguous, as an eager step's activations
        return flat[: m * k].view(m, k)

    F.linear(rows_of(64, HIDDEN), weights["qkv"])  # the library's own start
    print(f"BLAS library: {torch.backends.cuda.preferred_blas_library()}")
    print("new row counts: first call host us | again host us | device us")
    for m in (1599, 1615, 1650, 1700, 1777, 2047):
        first, again, device = [], [], []
        for name, w in weights.items():
            x = rows_of(m, w.shape[1])
            first.append(f"{name} {host_us(x, w):6.0f}")
            again.append(f"{host_us(x, w):4.0f}")
            device.append(f"{device_us(x, w):6.1f}")
        print(f"  M={m}: {'  '.join(first)} | {' '.join(again)} | {' '.join(device)}")
    t = time.perf_counter()
    for m in range(args.sweep_step, MAX_ROWS + 1, args.sweep_step):
        for w in weights.values():
            F.linear(rows_of(m, w.shape[1]), w)
    torch.cuda.synchronize()
    print(f"sweep of every {args.sweep_step}th row count to {MAX_ROWS}: {time.perf_counter() - t:.2f} s; then first "
          "calls (host us):")
    for m in (1607, 1608, 1617, 1003, 1000, 517):
        print(f"  M={m}: " + "  ".join(f"{name} {host_us(rows_of(m, w.shape[1]), w):6.0f}"
                                       for name, w in weights.items()))
    for m in (8, 9, 9, 17, 33):
        print(f"  LM head M={m}: {host_us(rows_of(m, HIDDEN), head):6.0f}")


if __name__ == "__main__":
    main()
