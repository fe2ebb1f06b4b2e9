"""Batch-1 linear layers as a GEMV that streams the weight at the memory bandwidth.

Owns: `linear(x, weight, bias)`, the decoder's y = x W^T (+ b), equal to `F.linear` up to the order of the fp32
sum, and `silu_and_mul_linear(x, weight)`, the MLP's silu(x G^T) * (x U^T) for [G | U] rows, equal to
`silu_and_mul(F.linear(x, weight))` up to the same order (each dot, the silu and the product rounded to the
activation dtype, as the unfused ops round them). A decode step of one sequence is a matrix-vector product per
weight: all it does is read the weight once. On the H200, launched one after another in a CUDA graph, cuBLAS reads
QKV at 70%, O at 62% and down at 80% of the copy bandwidth at batch 1, and gate/up with its activation kernel at 91%;
these kernels (each program streams BLOCK_N weight rows in BLOCK_K columns, fp32 products, one sum per row at the
end) read them at 83%, 76%, 94% and 98% (`bench/decode_gemms.py --gemv`,
`bench/results/2026-11-30-nvidia-h200-session16-gemv-pdl.txt`). Launched early (`ops/pdl.py`) in chains of the same
GEMV the sweep's figures scatter (O 10.1-13.6 us by tiling), but in the engine the tiling does not matter: W3 batch
1 4.40 / 4.41 / 4.41 ms with 8 x 512, 4 x 1024 and 16 x 512 (`-session16-gemv-tiles-ab.json`). Other shapes
(more than one row) go to `F.linear`, where cuBLAS's GEMM kernels are the right tool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused_norms import silu_and_mul
from .kv_write import HAVE_TRITON, _want_triton, device_context
from .pdl import launch_options

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import wait_for_predecessors

# H200 sweep (`decode_gemms.py --gemv`): 8 rows x 512 columns per tile, 4 warps, 3 stages was the best or within
# 3% of it on QKV (6144 x 4096), O (4096 x 4096) and down (4096 x 12288).
BLOCK_N = 8
BLOCK_K = 512
NUM_WARPS = 4
NUM_STAGES = 3
# The fused gate/up GEMV (24576 x 4096 on the 8B): 4 outputs (a gate and an up row each) in 1024-column tiles,
# 47.8 us against 50.2 for 8 x 512 and 51.5 for cuBLAS and the activation kernel (session 16 sweep).
SILU_BLOCK_N = 4
SILU_BLOCK_K = 1024
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAVE_TRITON:

    @triton.jit
    def _gemv_kernel(w_ptr, x_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
        # y[rows] = W[rows, :] . x, rows = this program's BLOCK_N; fp32 products summed per row at the end.
        wait_for_predecessors(PDL)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w
        rmask = rows < N
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kmask = k0 + cols < K
            w = tl.load(row_ptrs + (k0 + cols)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + cols, mask=kmask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _gemv_silu_and_mul_kernel(w_ptr, x_ptr, y_ptr, INTER, K, stride_w, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
        # y[i] = silu(W[i] . x) * (W[INTER + i] . x) for this program's BLOCK_N rows i: the gate row and its up row
        # streamed side by side, each dot rounded to the activation dtype, then silu rounded, as the unfused ops do.
        wait_for_predecessors(PDL)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        gate_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
        up_rows = w_ptr + (rows + INTER)[:, None].to(tl.int64) * stride_w  # (INTER may be a specialized constant)
        rmask = rows < INTER
        cols = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kmask = k0 + cols < K
            wmask = rmask[:, None] & kmask[None, :]
            x = tl.load(x_ptr + k0 + cols, mask=kmask, other=0.0).to(tl.float32)[None, :]
            acc_g += tl.load(gate_rows + (k0 + cols)[None, :], mask=wmask, other=0.0).to(tl.float32) * x
            acc_u += tl.load(up_rows + (k0 + cols)[None, :], mask=wmask, other=0.0).to(tl.float32) * x
        dtype = y_ptr.dtype.element_ty
        g = tl.sum(acc_g, axis=1).to(dtype).to(tl.float32)
        u = tl.sum(acc_u, axis=1).to(dtype).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(y_ptr + rows, (s * u).to(dtype), mask=rmask)


def _check_operands(weight: torch.Tensor, x: torch.Tensor) -> None:
    if weight.dim() != 2 or x.dim() != 1 or weight.shape[1] != x.shape[0]:
        raise ValueError(f"gemv needs weight [N, K] and x [K], got {tuple(weight.shape)} and {tuple(x.shape)}")
    if weight.stride(1) != 1 or x.stride(0) != 1:
        raise ValueError("gemv needs the weight's rows and x contiguous")


def gemv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (rows contiguous) @ x [K] -> [N] in x's dtype (Triton)."""
    _check_operands(weight, x)
    n, k = weight.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    with device_context(x.device):
        _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](weight, x, y, n, k, weight.stride(0), BLOCK_N=BLOCK_N,
                                                  BLOCK_K=BLOCK_K, NUM_STAGES=NUM_STAGES, num_warps=NUM_WARPS,
                                                  **launch_options(x.device))
    return y


def gemv_silu_and_mul(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [2I, K] as [gate | up] rows, x [K] -> silu(gate @ x) * (up @ x) [I] in x's dtype (Triton, one
    launch: the MLP's gate/up product and its activation at batch 1)."""
    _check_operands(weight, x)
    if weight.shape[0] % 2:
        raise ValueError(f"gemv_silu_and_mul needs [gate | up] rows (an even count), got {weight.shape[0]}")
    inter, k = weight.shape[0] // 2, weight.shape[1]
    y = torch.empty(inter, dtype=x.dtype, device=x.device)
    with device_context(x.device):
        _gemv_silu_and_mul_kernel[(triton.cdiv(inter, SILU_BLOCK_N),)](
            weight, x, y, inter, k, weight.stride(0), BLOCK_N=SILU_BLOCK_N, BLOCK_K=SILU_BLOCK_K,
            NUM_STAGES=NUM_STAGES, num_warps=NUM_WARPS, **launch_options(x.device))
    return y


def _takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype and x.dtype in _DTYPES
            and x.device == weight.device and weight.stride(1) == 1 and _want_triton(x.device, None))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; one row of x on a Triton device goes through `gemv`."""
    if _takes_gemv(x, weight):
        y = gemv(weight, x[0].contiguous())[None]
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul(F.linear(x, weight))` for [gate | up] weight rows; one row of x on a Triton device goes
    through `gemv_silu_and_mul`."""
    if _takes_gemv(x, weight):
        return gemv_silu_and_mul(weight, x[0].contiguous())[None]
    return silu_and_mul(F.linear(x, weight))
