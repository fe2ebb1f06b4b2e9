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
(more than one row) go to `ops.skinny_gemm` for a few rows (2 .. its `MAX_ROWS`, and O and down up to its
`NARROW_MAX_ROWS`, where it measured faster), else to `F.linear`, where cuBLAS's GEMM kernels are the right tool.

Also owns the decoder's residual add + RMSNorm folded into these GEMVs at batch 1 (`ResidualRow`): the O and down
GEMVs add their output to the residual stream in their epilogue and leave, beside the sum, its sum of squares in
per-program partials; the QKV and gate/up GEMVs that read the normed sum apply the norm in their prologue (the
partials summed, then each input tile normed as it is loaded). The same roundings as `ops.fused_norms.add_rms_norm`
(the sum rounded to the activation dtype, normed in fp32, rounded, times the weight, rounded); only the order of the
fp32 sum of squares differs. Two kernels fewer per decoder layer, each latency-bound at batch 1 (2.3 us on the
H200, `bench/profile_decode_step.py`); the folded GEMVs pay ~1 us of it back (the partial sums loaded and summed
before the first product; requesting the first weight tile before them was slower, it broke the loop's pipeline).
W3 batch 1 on the H200 (session 17, A/B on one machine): 4.40 -> 4.32 ms. The residual is loaded before the weight
loop: loaded after it, its latency lengthened the down GEMV by 1.4 us.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import skinny_gemm
from .kv_write import HAVE_TRITON, _want_triton, device_context
from .pdl import launch_options

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .fused_norms import _round, _silu_times
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
    def _rms_scale(sumsq_ptr, P, K, eps, BLOCK_P: tl.constexpr):
        """sqrt(mean(h^2) + eps) of a K-long row from the P partial sums of squares its producer left."""
        p = tl.arange(0, BLOCK_P)
        return tl.sqrt_rn(tl.sum(tl.load(sumsq_ptr + p, mask=p < P, other=0.0), axis=0) / K + eps)

    @triton.jit
    def _input_tile(x_ptr, k, kmask, norm_w_ptr, scale, NORM_IN: tl.constexpr, DTYPE: tl.constexpr):
        """Columns k of the GEMV's input in fp32; with NORM_IN, x is the residual row and the tile is RMSNorm'd
        with the row's `scale`, rounded as `fused_norms._normed` rounds (so as HF's RMSNorm)."""
        x = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        if NORM_IN:
            nw = tl.load(norm_w_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            x = _round(_round(x / scale, DTYPE) * nw, DTYPE)
        return x

    @triton.jit
    def _gemv_kernel(w_ptr, x_ptr, y_ptr, N, K, stride_w, sumsq_in_ptr, P_IN, norm_w_ptr, eps, res_ptr,
                     sumsq_out_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                     PDL: tl.constexpr, NORM_IN: tl.constexpr, BLOCK_P: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
        # y[rows] = W[rows, :] . x, rows = this program's BLOCK_N; fp32 products summed per row at the end.
        # NORM_IN: x is RMSNorm'd on the fly (its partial sums of squares at sumsq_in_ptr). ADD_RESIDUAL: y is
        # res + W . x, rounded, and this program's sum of its squares goes to sumsq_out_ptr[program].
        wait_for_predecessors(PDL)
        dtype = y_ptr.dtype.element_ty
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w
        rmask = rows < N
        cols = tl.arange(0, BLOCK_K)
        if ADD_RESIDUAL:  # requested first, so that its latency hides behind the weight stream
            res = tl.load(res_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        scale = 1.0
        if NORM_IN:
            scale = _rms_scale(sumsq_in_ptr, P_IN, K, eps, BLOCK_P)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kmask = k0 + cols < K
            w = tl.load(row_ptrs + (k0 + cols)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            x = _input_tile(x_ptr, k0 + cols, kmask, norm_w_ptr, scale, NORM_IN, dtype)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if ADD_RESIDUAL:
            # HF's `residual + x`: x rounded to the activation dtype first, then the sum rounded.
            y = _round(_round(y, dtype) + res, dtype)
            y = tl.where(rmask, y, 0.0)
            tl.store(sumsq_out_ptr + tl.program_id(0), tl.sum(y * y, axis=0))
        tl.store(y_ptr + rows, y.to(dtype), mask=rmask)

    @triton.jit
    def _gemv_silu_and_mul_kernel(w_ptr, x_ptr, y_ptr, INTER, K, stride_w, sumsq_in_ptr, P_IN, norm_w_ptr, eps,
                                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                                  PDL: tl.constexpr, NORM_IN: tl.constexpr, BLOCK_P: tl.constexpr):
        # y[i] = silu(W[i] . x) * (W[INTER + i] . x) for this program's BLOCK_N rows i: the gate row and its up row
        # streamed side by side, each dot rounded to the activation dtype, then silu rounded, as the unfused ops do.
        # NORM_IN: x is RMSNorm'd on the fly, as in `_gemv_kernel`.
        wait_for_predecessors(PDL)
        dtype = y_ptr.dtype.element_ty
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        gate_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
        up_rows = w_ptr + (rows + INTER)[:, None].to(tl.int64) * stride_w  # (INTER may be a specialized constant)
        rmask = rows < INTER
        cols = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        scale = 1.0
        if NORM_IN:
            scale = _rms_scale(sumsq_in_ptr, P_IN, K, eps, BLOCK_P)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kmask = k0 + cols < K
            wmask = rmask[:, None] & kmask[None, :]
            x = _input_tile(x_ptr, k0 + cols, kmask, norm_w_ptr, scale, NORM_IN, dtype)[None, :]
            acc_g += tl.load(gate_rows + (k0 + cols)[None, :], mask=wmask, other=0.0).to(tl.float32) * x
            acc_u += tl.load(up_rows + (k0 + cols)[None, :], mask=wmask, other=0.0).to(tl.float32) * x
        y = _silu_times(_round(tl.sum(acc_g, axis=1), dtype), _round(tl.sum(acc_u, axis=1), dtype), dtype)
        tl.store(y_ptr + rows, y.to(dtype), mask=rmask)


@dataclass(frozen=True)
class ResidualRow:
    """One row of the decoder's residual stream at batch 1, as the O and down GEMVs leave it (`gemv_add_residual`):
    `h` [K] the sum (activation dtype) and `sumsq` [P] fp32 the sums of squares of h's blocks of rows, which the
    next RMSNorm needs whole. `gemv_rms_normed` and `gemv_silu_and_mul_rms_normed` read it."""

    h: torch.Tensor
    sumsq: torch.Tensor

    def __post_init__(self) -> None:
        if self.h.dim() != 1 or self.h.stride(0) != 1:
            raise ValueError(f"ResidualRow.h must be one contiguous row, got {tuple(self.h.shape)}")
        if self.sumsq.dim() != 1 or self.sumsq.dtype != torch.float32 or self.sumsq.device != self.h.device:
            raise ValueError("ResidualRow.sumsq must be a 1-D fp32 tensor on h's device")


def _check_operands(weight: torch.Tensor, x: torch.Tensor) -> None:
    if weight.dim() != 2 or x.dim() != 1 or weight.shape[1] != x.shape[0]:
        raise ValueError(f"gemv needs weight [N, K] and x [K], got {tuple(weight.shape)} and {tuple(x.shape)}")
    if weight.stride(1) != 1 or x.stride(0) != 1:
        raise ValueError("gemv needs the weight's rows and x contiguous")


def _check_norm(row: ResidualRow, weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
    _check_operands(weight, row.h)
    if norm_weight.shape != row.h.shape or norm_weight.stride(0) != 1 or norm_weight.device != row.h.device:
        raise ValueError(f"the norm's weight {tuple(norm_weight.shape)} does not fit the row {tuple(row.h.shape)}")


def _norm_args(row: ResidualRow | None, unused: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The kernels' (sums of squares, their count) arguments; `unused` stands in for the pointer without a norm."""
    return (row.sumsq, row.sumsq.numel()) if row is not None else (unused, 1)


def _block_p(row: ResidualRow | None) -> int:
    return triton.next_power_of_2(row.sumsq.numel()) if row is not None else 1


def _launch_gemv(weight: torch.Tensor, x: torch.Tensor, *, norm: tuple[ResidualRow, torch.Tensor, float] | None,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, k = weight.shape
    programs = triton.cdiv(n, BLOCK_N)
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    sumsq_out = torch.empty(programs, dtype=torch.float32, device=x.device) if residual is not None else None
    row, norm_weight, eps = norm if norm is not None else (None, x, 0.0)
    with device_context(x.device):
        _gemv_kernel[(programs,)](
            weight, x, y, n, k, weight.stride(0), *_norm_args(row, y),
            norm_weight, eps, residual if residual is not None else y, sumsq_out if sumsq_out is not None else y,
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, NUM_STAGES=NUM_STAGES, NORM_IN=row is not None,
            BLOCK_P=_block_p(row), ADD_RESIDUAL=residual is not None,
            num_warps=NUM_WARPS, **launch_options(x.device))
    return y, sumsq_out


def gemv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (rows contiguous) @ x [K] -> [N] in x's dtype (Triton)."""
    _check_operands(weight, x)
    return _launch_gemv(weight, x, norm=None, residual=None)[0]


def gemv_add_residual(weight: torch.Tensor, x: torch.Tensor, residual: torch.Tensor) -> ResidualRow:
    """residual + weight @ x (rounded as HF's `residual + x`), with the sums of squares the next RMSNorm needs: the
    O and down projections of a batch-1 decoder layer, each with the residual add after it."""
    _check_operands(weight, x)
    if residual.shape != (weight.shape[0],) or residual.dtype != x.dtype or residual.stride(0) != 1:
        raise ValueError(f"the residual {tuple(residual.shape)} does not fit the output [{weight.shape[0]}]")
    return ResidualRow(*_launch_gemv(weight, x, norm=None, residual=residual))


def gemv_rms_normed(weight: torch.Tensor, row: ResidualRow, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight @ RMSNorm(row.h): the QKV projection of a batch-1 decoder layer with its input norm (one launch)."""
    _check_norm(row, weight, norm_weight)
    return _launch_gemv(weight, row.h, norm=(row, norm_weight, eps), residual=None)[0]


def _launch_gemv_silu_and_mul(weight: torch.Tensor, x: torch.Tensor,
                              norm: tuple[ResidualRow, torch.Tensor, float] | None) -> torch.Tensor:
    if weight.shape[0] % 2:
        raise ValueError(f"gemv_silu_and_mul needs [gate | up] rows (an even count), got {weight.shape[0]}")
    inter, k = weight.shape[0] // 2, weight.shape[1]
    y = torch.empty(inter, dtype=x.dtype, device=x.device)
    row, norm_weight, eps = norm if norm is not None else (None, x, 0.0)
    with device_context(x.device):
        _gemv_silu_and_mul_kernel[(triton.cdiv(inter, SILU_BLOCK_N),)](
            weight, x, y, inter, k, weight.stride(0), *_norm_args(row, y),
            norm_weight, eps, BLOCK_N=SILU_BLOCK_N, BLOCK_K=SILU_BLOCK_K, NUM_STAGES=NUM_STAGES,
            NORM_IN=row is not None, BLOCK_P=_block_p(row),
            num_warps=NUM_WARPS, **launch_options(x.device))
    return y


def gemv_silu_and_mul(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [2I, K] as [gate | up] rows, x [K] -> silu(gate @ x) * (up @ x) [I] in x's dtype (Triton, one
    launch: the MLP's gate/up product and its activation at batch 1)."""
    _check_operands(weight, x)
    return _launch_gemv_silu_and_mul(weight, x, None)


def gemv_silu_and_mul_rms_normed(weight: torch.Tensor, row: ResidualRow, norm_weight: torch.Tensor,
                                 eps: float) -> torch.Tensor:
    """`gemv_silu_and_mul(weight, RMSNorm(row.h))` in one launch: the MLP's input norm, gate/up and activation."""
    _check_norm(row, weight, norm_weight)
    return _launch_gemv_silu_and_mul(weight, row.h, (row, norm_weight, eps))


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` goes through the GEMV: one row on a Triton device, in the weight's dtype."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype and x.dtype in _DTYPES
            and x.device == weight.device and weight.stride(1) == 1 and _want_triton(x.device, None))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; one row of x on a Triton device goes through `gemv`, more through
    `skinny_gemm.linear` (its kernel for a few rows, else `F.linear`)."""
    if takes_gemv(x, weight):
        y = gemv(weight, x[0].contiguous())[None]
        return y if bias is None else y + bias
    return skinny_gemm.linear(x, weight, bias)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul(F.linear(x, weight))` for [gate | up] weight rows; one row of x on a Triton device goes
    through `gemv_silu_and_mul`, more through `skinny_gemm.silu_and_mul_linear`."""
    if takes_gemv(x, weight):
        return gemv_silu_and_mul(weight, x[0].contiguous())[None]
    return skinny_gemm.silu_and_mul_linear(x, weight)
