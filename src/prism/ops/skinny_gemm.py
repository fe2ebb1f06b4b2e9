"""Linear layers of a few rows (a decode step of a small batch) as a Triton GEMM that streams the weight.

Owns: `linear(x, weight)` and `silu_and_mul_linear(x, weight)` for the few rows `takes_skinny_gemm` names, equal to
`F.linear(x, weight)` and `silu_and_mul(F.linear(x, weight))` up to the order of the fp32 sums (each output rounded
to the activation dtype, as cuBLAS rounds it; the activation rounded as `fused_norms.silu_and_mul` rounds it).

Why: at decode batch 8-32 a step reads the same 15 GB of weights as at batch 1, and cuBLAS reads the 8B's QKV at
73-76%, O at 62-65% and down at 80-82% of the copy bandwidth there, gate/up at 88% at 8 rows
(`bench/results/2026-11-29-nvidia-h200-decode-gemms.txt`), and splits O's and down's K with a reduce kernel after
each at 32 rows (`-session17-profile-decode-step-b32.txt`). The batch-1 GEMV (`ops/gemv.py`) reads them at 77-98% by
giving each program a few whole weight rows to stream; this is the same shape of kernel with the rows of x as the
M side of tensor-core tiles (`tl.dot`), so one weight tile serves every row of the step.

Status: on for 2 .. 16 rows (`MAX_ROWS`, measured below), and at 17 .. 32 rows for the narrow layers (O and down,
`NARROW_*`) with K split over two programs per output tile, and for the others (QKV, gate/up: `WIDE_*`) as a swap-AB
GEMM, the weight's rows on the MMA's M side. Every layer that goes through
`gemv.linear` / `gemv.silu_and_mul_linear` takes it at those row counts (`DecodeLinear` with `batch1_gemv` set,
`TextMLP`'s gate/up, tensor parallelism's row-parallel layers), so short prefills and the small packed graphs do
too. A split launch adds its fp32 partials in split order in a second launch (adding them in the GEMM's last
program per tile instead was slower at 32 rows: `bench/NOTES.md`, session 19). The Triton interpreter's `tl.dot`
is wrong for bf16 operands, so the CPU tests call the kernel in fp32 / fp16 directly.
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

    from .fused_norms import _round, _silu_times
    from .pdl import wait_for_predecessors

# Steps of 2 .. MAX_ROWS rows take these kernels (0: none, nor the narrow band's: F.linear for all). Tiles: BLOCK_N
# weight rows (outputs) per program in BLOCK_K columns, the step's rows padded to a power of two of at least 16 (`tl.dot`'s least M).
# H200 sweep (2026-11-30, `-session18-decode-gemms-skinny.txt`), us against cuBLAS: at 8 rows it wins every
# projection (QKV 16.0 / 16.5, O 11.4 / 12.2, down 27.9 / 29.5, gate/up with its activation 48.3 / 54.6 with the
# SILU tiles); at 32 rows it loses or ties every one (QKV 16.6 / 15.7, down 37.7 / 28.6). In the engine (A/B,
# `-session18-skinny16-ab.json`): W3 batch 8 5.49 -> 5.39 ms, batch 16 5.46 -> 5.45, W2's engine part 7.67 -> 7.39.
MAX_ROWS = 16
BLOCK_N = 64
BLOCK_K = 256
SILU_BLOCK_N = 32
SILU_BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 4
# Programs along K per output tile at 2 .. MAX_ROWS rows (1: none). Above 1 each program leaves an fp32 partial
# product of its share of K and the partials are added in split order, then rounded (and the activation applied) as
# the one-program kernel does: more programs for a narrow layer, at the price of the partials' round trip, as cuBLAS
# pays with its split-K reduce. Measured at 32 rows only (the narrow band below): off here.
SPLIT_K = 1
# The narrow band: steps of MAX_ROWS + 1 .. NARROW_MAX_ROWS rows take the kernel for launches of at most
# NARROW_MAX_TILES output tiles of BLOCK_N (no activation), their K split NARROW_SPLIT_K ways; the rest keep cuBLAS.
# H200 sweep at 32 rows (2026-11-30, `-session19-decode-gemms-skinny-split.txt`), us against cuBLAS: O (64 tiles)
# 11.5 / 13.8, down (64 tiles) 27.8 / 28.6, both 64 x 256 tiles, 2 splits; QKV (96 tiles) 20.9 / 16.1 with those
# tiles (15.9 at best, 128 x 128), gate/up + activation 52.4 / 50.7 at best. The rule is a tile count, not a layer:
# it also takes tensor parallelism's narrow shards (TP2's QKV, 3,072 outputs in 48 tiles; its O and down, K halved),
# measured only in TP2's whole step. Splitting every launch to >= 264 programs lost at batch 8 and 32
# (`-session19-skinny-split-ab.json`: batch 8 5.08 -> 5.17 ms; with MAX_ROWS 32, batch 32 5.68 -> 6.03).
NARROW_MAX_ROWS = 32
NARROW_MAX_TILES = 64
NARROW_SPLIT_K = 2
# The wide band: steps of MAX_ROWS + 1 .. WIDE_MAX_ROWS rows take the kernel for the launches the narrow band leaves
# (the 8B's QKV, and gate/up with its activation), as a swap-AB GEMM: WIDE_BLOCK_N weight rows per program on the
# tensor-core MMA's M side (64, the least of Hopper's warpgroup MMA), the step's rows on its N side; K is not split.
# At 17-32 rows the other orientation pads the step's rows to that M (or leaves the warpgroup MMA), which is why
# these launches lost to cuBLAS. H200 sweep at 32 rows (session 27, `bench/gemv_stream.py`,
# `-session27-gemv-stream-m32.txt`), us against cuBLAS: QKV 15.45 / 16.40 (64 x 256 tiles, 4 stages), gate/up
# without its activation 50.88 / 51.58 (64 x 128, 3 stages); with it, the activation's own launch after cuBLAS goes.
WIDE_MAX_ROWS = 32
WIDE_BLOCK_N = 64
WIDE_BLOCK_K = 256
WIDE_SILU_BLOCK_K = 128
WIDE_NUM_STAGES = 4
# The pipeline's stages are cut so that their tiles (x's rows and the weight's, each stage) fit this many bytes of
# shared memory (the H200 has 227 KB per block): at 64 rows in fp32 four stages would not compile.
SHARED_MEMORY_BUDGET = 192 * 1024
# Dispatch takes 16-bit activations only: an fp32 model (the tests' tiny checkpoints) keeps F.linear.
_DTYPES = (torch.bfloat16, torch.float16)

if HAVE_TRITON:

    @triton.jit
    def _rounded_output(acc, acc_up, dtype, SILU: tl.constexpr):
        """The output of fp32 products: rounded to the activation dtype; SILU: silu(gate) * up, each step rounded as
        `fused_norms.silu_and_mul` rounds it."""
        if SILU:
            return _silu_times(_round(acc, dtype), _round(acc_up, dtype), dtype)
        return _round(acc, dtype)

    @triton.jit
    def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, part_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_w, stride_ym,
                            INTER, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            NUM_STAGES: tl.constexpr, SILU: tl.constexpr, SPLIT_K: tl.constexpr,
                            PRECISION: tl.constexpr, PDL: tl.constexpr, SWAP_AB: tl.constexpr = False):
        # y[:, cols] = x . W[cols, :]^T for this program's BLOCK_N output columns; SILU: y[:, i] = silu(x . W[i])
        # * (x . W[INTER + i]), each product rounded to the activation dtype, then the silu, then their product.
        # SPLIT_K > 1: program (tile, split) sums K columns [split, split + 1) * K_PER_SPLIT (a multiple of BLOCK_K)
        # and stores its fp32 partials at part_ptr [SPLIT_K, 1 + SILU, M, N] for `_split_sums_kernel`.
        # SWAP_AB (one split only): the same sums as y^T[cols, :] = W[cols, :] . x^T, the weight's rows on the MMA's
        # M side (the wide band's tiles).
        wait_for_predecessors(PDL)
        dtype = y_ptr.dtype.element_ty
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        k_lo = split * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        cmask = cols < N
        m = tl.arange(0, BLOCK_M)
        mmask = m < M
        k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
        up_rows = w_ptr + (cols + INTER)[:, None].to(tl.int64) * stride_w
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            kmask = k0 + k < k_hi
            x = tl.load(x_rows + (k0 + k)[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            wmask = cmask[:, None] & kmask[None, :]
            w = tl.load(w_rows + (k0 + k)[None, :], mask=wmask, other=0.0)
            if SWAP_AB:
                acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if SILU:
                up = tl.load(up_rows + (k0 + k)[None, :], mask=wmask, other=0.0)
                if SWAP_AB:
                    acc_up = tl.dot(up, tl.trans(x), acc_up, input_precision=PRECISION)
                else:
                    acc_up = tl.dot(x, tl.trans(up), acc_up, input_precision=PRECISION)
        if SWAP_AB:
            tl.store(y_ptr + m[None, :].to(tl.int64) * stride_ym + cols[:, None],
                     _rounded_output(acc, acc_up, dtype, SILU).to(dtype), mask=cmask[:, None] & mmask[None, :])
        elif SPLIT_K == 1:
            tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + cols[None, :],
                     _rounded_output(acc, acc_up, dtype, SILU).to(dtype), mask=mmask[:, None] & cmask[None, :])
        else:
            omask = mmask[:, None] & cmask[None, :]
            parts = 2 if SILU else 1
            at = ((split * parts) * M + m[:, None]).to(tl.int64) * N + cols[None, :]
            tl.store(part_ptr + at, acc, mask=omask)
            if SILU:
                tl.store(part_ptr + at + tl.cast(M, tl.int64) * N, acc_up, mask=omask)

    @triton.jit
    def _split_sums_kernel(part_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr, SILU: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
        # grid = (cdiv(M * N, BLOCK),): each output of a split-K skinny GEMM, its SPLIT_K fp32 partials added in
        # split order, then rounded (SILU: the activation) as the one-program kernel rounds.
        wait_for_predecessors(PDL)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        outputs = tl.cast(M, tl.int64) * N  # one part's size; a split holds 1 + SILU parts
        mask = i < outputs
        stride_split = (2 if SILU else 1) * outputs
        acc = tl.load(part_ptr + i, mask=mask, other=0.0)
        acc_up = acc
        if SILU:
            acc_up = tl.load(part_ptr + outputs + i, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(part_ptr + s * stride_split + i, mask=mask, other=0.0)
            if SILU:
                acc_up += tl.load(part_ptr + s * stride_split + outputs + i, mask=mask, other=0.0)
        y = _rounded_output(acc, acc_up, y_ptr.dtype.element_ty, SILU)
        row, col = i // N, i % N
        tl.store(y_ptr + row * stride_ym + col, y.to(y_ptr.dtype.element_ty), mask=mask)


def tiles(rows: int, silu: bool, element_size: int, wide: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, pipeline stages) of a launch: the rows padded to a power of two of at least 16
    (`tl.dot`'s least M), the module's tiles (`wide`: the wide band's), and the stages cut so that every stage's
    tiles (x's rows and one or two weight tiles) fit `SHARED_MEMORY_BUDGET`."""
    block_m = max(16, triton.next_power_of_2(rows))
    if wide:
        block_n, block_k, stages = WIDE_BLOCK_N, WIDE_SILU_BLOCK_K if silu else WIDE_BLOCK_K, WIDE_NUM_STAGES
    else:
        block_n, block_k = (SILU_BLOCK_N, SILU_BLOCK_K) if silu else (BLOCK_N, BLOCK_K)
        stages = NUM_STAGES
    stage_bytes = (block_m + (2 if silu else 1) * block_n) * block_k * element_size
    return block_m, block_n, block_k, max(1, min(stages, SHARED_MEMORY_BUDGET // stage_bytes))


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"skinny_gemm.{name} must be a positive int, got {value!r}")
    return value


def in_narrow_band(rows: int, n: int, silu: bool) -> bool:
    """Whether a launch of `rows` rows and `n` outputs is in the narrow band: MAX_ROWS + 1 .. NARROW_MAX_ROWS rows
    (none when either is 0), no activation, at most NARROW_MAX_TILES output tiles. (Plain Python: dispatch asks it
    on machines without Triton too.)"""
    return (not silu and 0 < MAX_ROWS < rows <= NARROW_MAX_ROWS
            and -(-n // max(BLOCK_N, 1)) <= NARROW_MAX_TILES)


def in_wide_band(rows: int, n: int, silu: bool) -> bool:
    """Whether a launch is in the wide band: MAX_ROWS + 1 .. WIDE_MAX_ROWS rows (none when either is 0), and not in
    the narrow band (which takes it first). (Plain Python, as `in_narrow_band`.)"""
    return 0 < MAX_ROWS < rows <= WIDE_MAX_ROWS and not in_narrow_band(rows, n, silu)


def asked_splits(rows: int, n: int, silu: bool) -> int:
    """The splits of K a launch asks for: `NARROW_SPLIT_K` in the narrow band, one in the wide band, else `SPLIT_K`.
    (A K of fewer tiles takes fewer: no split is empty.)"""
    if in_wide_band(rows, n, silu):
        return 1
    if in_narrow_band(rows, n, silu):
        return _positive_int("NARROW_SPLIT_K", NARROW_SPLIT_K)
    return _positive_int("SPLIT_K", SPLIT_K)


def takes_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, silu: bool = False) -> bool:
    """Whether `linear(x, weight)` (`silu`: `silu_and_mul_linear`) runs this kernel: 2 .. MAX_ROWS rows, the narrow
    band or the wide band, on a Triton device, in the weight's dtype, both with unit stride along K."""
    if not (x.dim() == 2 and weight.dim() == 2):
        return False
    if not (x.dtype == weight.dtype and x.dtype in _DTYPES and x.device == weight.device
            and x.shape[1] == weight.shape[1] and weight.stride(1) == 1 and x.stride(1) == 1
            and _want_triton(x.device, None)):
        return False
    rows, n = x.shape[0], weight.shape[0] // 2 if silu else weight.shape[0]
    return 2 <= rows <= MAX_ROWS or in_narrow_band(rows, n, silu) or in_wide_band(rows, n, silu)


def _launch(x: torch.Tensor, weight: torch.Tensor, silu: bool) -> torch.Tensor:
    if (x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or x.stride(1) != 1
            or weight.stride(1) != 1):
        raise ValueError(f"skinny GEMM needs x [M, K] and weight [N, K] with unit stride along K, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    rows, k = x.shape
    if silu and weight.shape[0] % 2:
        raise ValueError(f"the fused gate/up GEMM needs [gate | up] rows (an even count), got {weight.shape[0]}")
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    if k == 0:  # empty sums, as F.linear gives them (and silu(0) * 0)
        return torch.zeros(rows, n, dtype=x.dtype, device=x.device)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    wide = in_wide_band(rows, n, silu)
    block_m, block_n, block_k, stages = tiles(rows, silu, x.element_size(), wide)
    out_tiles = triton.cdiv(n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, asked_splits(rows, n, silu)), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)  # a short K takes fewer splits than asked: none is empty
    parts = (torch.empty((splits, 2 if silu else 1, rows, n), dtype=torch.float32, device=x.device)
             if splits > 1 else y)  # unused with one split
    with device_context(x.device):
        _skinny_gemm_kernel[(out_tiles, splits)](
            x, weight, y, parts, rows, n, k, k_per_split, x.stride(0), weight.stride(0), y.stride(0),
            n if silu else 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, SILU=silu,
            SPLIT_K=splits, SWAP_AB=wide, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding
            num_warps=NUM_WARPS, **launch_options(x.device))
        if splits > 1:
            block = 1024
            _split_sums_kernel[(triton.cdiv(rows * n, block),)](
                parts, y, rows, n, y.stride(0), SPLIT_K=splits, SILU=silu, BLOCK=block, **launch_options(x.device))
    return y


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype (Triton). Meant for a few rows: x's rows are one tile of
    the next power of two (at least 16), which stops compiling past the shared memory at a few hundred rows."""
    return _launch(x, weight, silu=False)


def skinny_gemm_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K], weight [2I, K] as [gate | up] rows -> silu(x G^T) * (x U^T) [M, I] in one launch."""
    return _launch(x, weight, silu=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; the launches `takes_skinny_gemm` names go through `skinny_gemm`. A bias is added
    to the rounded product (a second rounding, where cuBLAS adds it before its one): Qwen3-VL's layers have none."""
    if takes_skinny_gemm(x, weight):
        y = skinny_gemm(x, weight)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul(F.linear(x, weight))` for [gate | up] weight rows; 2 .. MAX_ROWS rows and the wide band on a
    Triton device go through `skinny_gemm_silu_and_mul` (the narrow band takes no activation)."""
    if takes_skinny_gemm(x, weight, silu=True):
        return skinny_gemm_silu_and_mul(x, weight)
    return silu_and_mul(F.linear(x, weight))
