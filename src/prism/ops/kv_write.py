"""Writing the new tokens' K/V into the paged pool (with scaled-FP8 quantization on the way in).

Owns the write half of invariant 4's format: the bytes a step leaves in the pool are exactly
`fp8.quantize_kv` of its K and V (one fp32 scale per token per KV head, K and V separately) for an fp8 pool,
and a round-to-nearest-even cast for unscaled pools. `write_kv_reference` is the spec; the Triton kernel
quantizes in the same pass and must reproduce it byte for byte.

Addressing: slot s = page * page_size + row. The pool is viewed as rows `[2*L, P*S, X]` (row = kv * L + layer,
X = H*D for the payload, H for the scales); element (row, slot, i) sits at `row * stride_row + slot *
stride_slot + i`, computed by `slot_offset` in `_OFFSET_DTYPE` (int64, read at every launch, as in page_copy).

Bit-exactness: the kernel does every rounding step with integer arithmetic (fp32 -> E4M3FN and fp32 -> bf16,
round to nearest even) and IEEE division (`div_rn`), so the compiled kernel, the Triton interpreter (whose
float8/bf16 casts do not round to nearest even) and torch agree bit for bit.

Slot values are validated on the host when `slots` is a host tensor; device slots are not read back (no sync
per layer): they come from `PagedAttentionMetadata.build`, which validated them, and the kernel skips any slot
outside the pool rather than write out of bounds.
"""

from __future__ import annotations

import contextlib

import torch

from ..kv import fp8
from ..kv.fp8 import KVPool
from .dispatch import want_triton

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # the `kernels` extra is optional; the torch reference still works
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAVE_TRITON = False

# Payload kinds, as the kernels' KIND constexpr.
KIND_FP8, KIND_BF16, KIND_FP16, KIND_FP32 = 0, 1, 2, 3
_KINDS = {"fp8": KIND_FP8, "bf16": KIND_BF16, "fp16": KIND_FP16, "fp32": KIND_FP32}
# Integer views the kernels store into (bit patterns are produced in-kernel for fp8 and bf16).
_STORE_VIEW = {"fp8": torch.uint8, "bf16": torch.int16, "fp16": torch.float16, "fp32": torch.float32}
# Elements of one program's [heads, head_dim] tile.
_TILE_ELEMS = 4096


def _check_layer(pool: KVPool, layer: int) -> None:
    n = pool.layout.num_layers
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < n:
        raise IndexError(f"layer={layer!r} out of range [0, {n})")


def _check_write_inputs(pool: KVPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check_layer(pool, layer)
    lay = pool.layout
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
        got = f"{slots.dtype} {tuple(slots.shape)}" if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise ValueError(f"slots must be a 1-D int64 tensor, got {got}")
    want = (slots.numel(), lay.num_kv_heads, lay.head_dim)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor")
        if tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [N, H_kv, D] = {want}")
        if t.device != pool.device:
            raise ValueError(f"{name} is on {t.device}, the pool on {pool.device}")
    if slots.device.type == "cpu" and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= lay.num_slots:
            raise ValueError(f"slots out of range [0, {lay.num_slots}): min {lo}, max {hi}")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slots must be distinct (two tokens written to one slot in one step)")


def row_strides(layout: fp8.KVLayout) -> tuple[int, int, int]:
    """(stride_row, stride_slot, sc_stride_row): the strides of the pool's row view `[2*L, P*S, X]` (see the module
    docstring) that every kernel's `slot_offset` takes, for the payload rows, its slots and the scale rows."""
    return (layout.num_slots * layout.num_kv_heads * layout.head_dim, layout.num_kv_heads * layout.head_dim,
            layout.num_slots * layout.num_kv_heads)


def store_operands(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
    """The payload as the view the write kernels store into, and the scales (the payload when unscaled: unused)."""
    pay = pool.payload.view(_STORE_VIEW[pool.layout.kv_dtype])
    return pay, pool.scales if pool.scales is not None else pay


def _row_view(t: torch.Tensor, layout: fp8.KVLayout) -> torch.Tensor:
    """[2, L, P, S, H(, D)] -> [2, L, P*S, X] (a view of the contiguous pool)."""
    return t.view(2, layout.num_layers, layout.num_slots, -1)


def write_kv_reference(pool: KVPool, layer: int, slots: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> None:
    """Spec: K/V of token i -> slot slots[i] of `layer` (fp8: `fp8.quantize_kv`, payload and scales; else a
    round-to-nearest-even cast)."""
    _check_write_inputs(pool, layer, slots, k, v)
    if slots.numel() == 0:
        return
    lay = pool.layout
    idx = slots.to(pool.device)
    pay = _row_view(pool.payload_bits(), lay)
    for kv, x in ((0, k), (1, v)):
        if lay.scaled:
            assert pool.scales is not None
            q, scale = fp8.quantize_kv(x)
            pay[kv, layer].index_copy_(0, idx, q.view(torch.uint8).reshape(len(idx), -1))
            _row_view(pool.scales, lay)[kv, layer].index_copy_(0, idx, scale)
        else:
            cast = x.to(lay.payload_dtype).view(pay.dtype)
            pay[kv, layer].index_copy_(0, idx, cast.reshape(len(idx), -1))


# ---------------------------------------------------------------------------------------------- Triton


def _want_triton(device: torch.device, use_triton: bool | None) -> bool:
    return want_triton(device, use_triton, have_triton=HAVE_TRITON, interpreted=_INTERPRETED)


if HAVE_TRITON:
    _OFFSET_DTYPE = tl.int64
    _E4M3_MAX = tl.constexpr(fp8.E4M3_MAX)
    _SCALE_EPS = tl.constexpr(fp8.SCALE_EPS)

    @triton.jit
    def slot_offset(row, slot, inner, stride_row, stride_slot, OFFSET_DTYPE: tl.constexpr):
        # The one address formula of the write and attention kernels (int32 OFFSET_DTYPE wraps past 2^31).
        return tl.cast(row, OFFSET_DTYPE) * stride_row + tl.cast(slot, OFFSET_DTYPE) * stride_slot + tl.cast(inner, OFFSET_DTYPE)

    @triton.jit
    def e4m3_bits(y):
        """fp32 y with |y| <= 448 -> int32 holding its E4M3FN byte, round to nearest even (torch's cast)."""
        u = y.to(tl.int32, bitcast=True)
        sign = (u >> 24) & 0x80
        a = u & 0x7FFFFFFF
        # |y| >= 2^-6 (E4M3 normal): keep 3 of 23 mantissa bits with RNE, then rebias the exponent 127 -> 7.
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
        # |y| < 2^-6: the byte is round(|y| * 2^9) (the subnormal quantum is 2^-9); y = m * 2^(e - 150).
        e = a >> 23
        m = (a & 0x7FFFFF) | 0x800000
        shift = tl.minimum(141 - e, 30)  # >= 21 here; 30 already rounds every such m to 0
        q = m >> shift
        rem = m & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
        return tl.where(a >= (121 << 23), normal, q) | sign

    @triton.jit
    def bf16_bits(x):
        """fp32 x (finite) -> int32 holding its bf16 bit pattern, round to nearest even (torch's cast)."""
        u = x.to(tl.int32, bitcast=True)
        a = u & 0x7FFFFFFF
        return ((a + 0x7FFF + ((a >> 16) & 1)) >> 16) | ((u >> 16) & 0x8000)

    @triton.jit
    def _store_values(x, scale, dst, mask, KIND: tl.constexpr):
        """fp32 values [heads, columns] -> payload elements at `dst`; fp8 divides by the heads' `scale` [heads]."""
        if KIND == 0:
            y = tl.math.div_rn(x, scale[:, None])
            y = tl.minimum(tl.maximum(y, -_E4M3_MAX), _E4M3_MAX)
            tl.store(dst, e4m3_bits(y).to(tl.uint8), mask=mask)
        elif KIND == 1:
            tl.store(dst, bf16_bits(x).to(tl.int16), mask=mask)
        elif KIND == 2:
            tl.store(dst, x.to(tl.float16), mask=mask)
        else:
            tl.store(dst, x, mask=mask)

    @triton.jit
    def _fp8_scale(amax):
        return tl.maximum(tl.math.div_rn(amax, _E4M3_MAX), _SCALE_EPS)

    @triton.jit
    def _write_one(src_ptr, s_t, s_h, s_d, pay_ptr, sc_ptr, t, slot, ok, row, h, d, H, D,
                   stride_row, stride_slot, sc_stride_row,
                   KIND: tl.constexpr, OFFSET_DTYPE: tl.constexpr):
        mask = (h < H)[:, None] & (d < D)[None, :] & ok
        src = (src_ptr + t.to(tl.int64) * s_t + h.to(tl.int64)[:, None] * s_h + d.to(tl.int64)[None, :] * s_d)
        x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        inner = h[:, None] * D + d[None, :]
        dst = pay_ptr + slot_offset(row, slot, inner, stride_row, stride_slot, OFFSET_DTYPE)
        scale = _fp8_scale(tl.max(tl.abs(x), axis=1))
        _store_values(x, scale, dst, mask, KIND)
        if KIND == 0:
            tl.store(sc_ptr + slot_offset(row, slot, h, sc_stride_row, H, OFFSET_DTYPE), scale, mask=(h < H) & ok)

    @triton.jit
    def write_head_halves(x1, x2, pay_ptr, sc_ptr, slot, ok, row, h, j, H, HALF: tl.constexpr,
                          stride_row, stride_slot, sc_stride_row, KIND: tl.constexpr, OFFSET_DTYPE: tl.constexpr):
        """One token's heads given as halves [heads, HALF] in registers (what rope produces) -> `slot` of pool
        row `row`: the same bytes `_write_one` stores for the concatenated heads (one scale per head)."""
        mask = (h < H)[:, None] & (j < HALF)[None, :] & ok
        dst = pay_ptr + slot_offset(row, slot, h[:, None] * (2 * HALF) + j[None, :], stride_row, stride_slot,
                                    OFFSET_DTYPE)
        scale = _fp8_scale(tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1)))
        _store_values(x1, scale, dst, mask, KIND)
        _store_values(x2, scale, dst + HALF, mask, KIND)
        if KIND == 0:
            tl.store(sc_ptr + slot_offset(row, slot, h, sc_stride_row, H, OFFSET_DTYPE), scale, mask=(h < H) & ok)

    @triton.jit(do_not_specialize=["row_k", "row_v"])  # one variant for every layer
    def _write_kv_kernel(k_ptr, v_ptr, slots_ptr, pay_ptr, sc_ptr,
                         k_st, k_sh, k_sd, v_st, v_sh, v_sd,
                         row_k, row_v, num_slots, H, D, stride_row, stride_slot, sc_stride_row,
                         KIND: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         OFFSET_DTYPE: tl.constexpr):
        # grid = (tokens, 2 [K, V], head blocks): one program quantizes and stores one token's heads of K or V.
        t = tl.program_id(0)
        which = tl.program_id(1)
        h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        slot = tl.load(slots_ptr + t)
        ok = (slot >= 0) & (slot < num_slots)
        if which == 0:
            _write_one(k_ptr, k_st, k_sh, k_sd, pay_ptr, sc_ptr, t, slot, ok, row_k, h, d, H, D,
                       stride_row, stride_slot, sc_stride_row, KIND, OFFSET_DTYPE)
        else:
            _write_one(v_ptr, v_st, v_sh, v_sd, pay_ptr, sc_ptr, t, slot, ok, row_v, h, d, H, D,
                       stride_row, stride_slot, sc_stride_row, KIND, OFFSET_DTYPE)

    _INTERPRETED = type(_write_kv_kernel).__name__ == "InterpretedFunction"
else:
    _OFFSET_DTYPE = None
    _INTERPRETED = False


def device_context(dev: torch.device):
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def write_kv(pool: KVPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
             use_triton: bool | None = None) -> None:
    """K/V of the N new tokens ([N, H_kv, D] each) -> slots `slots` (int64 [N]) of `layer`; fp8 pools quantize.

    Same bytes as `write_kv_reference`. Triton on CUDA (one launch, quantizing in the same pass), the reference
    on CPU unless `use_triton=True` (CPU then needs TRITON_INTERPRET=1).
    """
    if not _want_triton(pool.device, use_triton):
        write_kv_reference(pool, layer, slots, k, v)
        return
    _check_write_inputs(pool, layer, slots, k, v)
    n = slots.numel()
    if n == 0:
        return
    lay = pool.layout
    if slots.device != pool.device:
        slots = slots.to(pool.device)
    pay, sc = store_operands(pool)
    block_d = triton.next_power_of_2(lay.head_dim)
    block_h = min(triton.next_power_of_2(lay.num_kv_heads), max(1, _TILE_ELEMS // block_d))
    grid = (n, 2, triton.cdiv(lay.num_kv_heads, block_h))
    with device_context(pool.device):
        _write_kv_kernel[grid](
            k, v, slots, pay, sc,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            layer, lay.num_layers + layer, lay.num_slots, lay.num_kv_heads, lay.head_dim, *row_strides(lay),
            KIND=_KINDS[lay.kv_dtype], BLOCK_H=block_h, BLOCK_D=block_d, OFFSET_DTYPE=_OFFSET_DTYPE,
        )
