"""Batch-1 linear layers as a GEMV that streams the weight at the memory bandwidth.

Owns: `linear(x, weight, bias)`, the decoder's y = x W^T (+ b), equal to `F.linear` up to the order of the fp32
sum. A decode step of one sequence is a matrix-vector product per weight: all it does is read the weight once.
On the H200 cuBLAS reads QKV at 76%, O at 62% and down at 80% of the copy bandwidth at batch 1; this kernel (each
program streams BLOCK_N weight rows in BLOCK_K columns, fp32 products, one sum per row at the end) reads them at
81%, 76% and 94% (`bench/decode_gemms.py --gemv`, `bench/results/2026-11-30-nvidia-h200-gemv.txt`). Other shapes
(more than one row) go to `F.linear`, where cuBLAS's GEMM kernels are the right tool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_write import HAVE_TRITON, _want_triton, device_context

if HAVE_TRITON:
    import triton
    import triton.language as tl

# H200 sweep (`decode_gemms.py --gemv`): 8 rows x 512 columns per tile, 4 warps, 3 stages was the best or within
# 3% of it on QKV (6144 x 4096), O (4096 x 4096) and down (4096 x 12288).
BLOCK_N = 8
BLOCK_K = 512
NUM_WARPS = 4
NUM_STAGES = 3
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAVE_TRITON:

    @triton.jit
    def _gemv_kernel(w_ptr, x_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
        # y[rows] = W[rows, :] . x, rows = this program's BLOCK_N; fp32 products summed per row at the end.
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kmask = k0 + cols < K
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + (k0 + cols)[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + cols, mask=kmask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rmask)


def gemv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (rows contiguous) @ x [K] -> [N] in x's dtype (Triton)."""
    if weight.dim() != 2 or x.dim() != 1 or weight.shape[1] != x.shape[0]:
        raise ValueError(f"gemv needs weight [N, K] and x [K], got {tuple(weight.shape)} and {tuple(x.shape)}")
    if weight.stride(1) != 1 or x.stride(0) != 1:
        raise ValueError("gemv needs the weight's rows and x contiguous")
    n, k = weight.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    with device_context(x.device):
        _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](weight, x, y, n, k, weight.stride(0), BLOCK_N=BLOCK_N,
                                                  BLOCK_K=BLOCK_K, NUM_STAGES=NUM_STAGES, num_warps=NUM_WARPS)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; one row of x on a Triton device goes through `gemv`."""
    if (x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype and x.dtype in _DTYPES
            and x.device == weight.device and weight.stride(1) == 1 and _want_triton(x.device, None)):
        y = gemv(weight, x[0].contiguous())[None]
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)
