"""Scaled-FP8 paged KV format: pool layout, 64-bit addressing, capacity arithmetic, reference quantization.

Owns invariant 4's format half ("FP8 addressing"): the KV pool is two flat tensors,

    payload [2, L, P, S, H, D]   (K/V, layer, page, slot, KV head, head dim)
    scales  [2, L, P, S, H]      fp32, one per (token, KV head), separately for K and V (scaled formats only)

and every element offset into them is a Python int computed from the real contiguous strides (the pools of
real models pass 2^31 elements: Qwen3-VL-8B's FP8 pool overflowed int32 at K/V layer row 38). The torch
functions `quantize_kv` / `dequantize_kv` are the specification of the scaled-FP8 format that the KV-write
and attention kernels must reproduce; the capacity functions give the page counts the engine allocates and
the W6 capacity figures.

Formats (`KVDtype`):
    "fp8"   E4M3FN payload + fp32 scale per (token, KV head) for K and for V
    "bf16"  bf16 payload, no scales
    "fp16", "fp32"  unscaled payloads (cheap, useful for CPU tests)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

E4M3_MAX = 448.0
# Lower bound of every scale. An all-zero (or denormal-tiny) row would otherwise get scale 0 and x / 0 = NaN;
# with the floor the division stays finite and zeros quantize to exact zeros. 1e-8 is far below any amax
# that matters (values under 448 * 1e-8 ~ 4.5e-6 lose precision, which attention cannot see) and far above
# fp32's smallest normal (1.2e-38), so `x / scale` cannot overflow for any finite fp32 x below 448 * 1e-8.
SCALE_EPS = 1e-8

KVDtype = Literal["fp8", "bf16", "fp16", "fp32"]
KV_DTYPES: tuple[str, ...] = get_args(KVDtype)

_PAYLOAD_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
_SCALED: frozenset[str] = frozenset({"fp8"})
_BITS_DTYPES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
GIB = 1 << 30
MIB = 1 << 20


def _check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in _PAYLOAD_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; expected one of {KV_DTYPES}")


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass; a True page count is a bug, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def payload_dtype_of(kv_dtype: KVDtype) -> torch.dtype:
    _check_kv_dtype(kv_dtype)
    return _PAYLOAD_DTYPES[kv_dtype]


def is_scaled(kv_dtype: KVDtype) -> bool:
    _check_kv_dtype(kv_dtype)
    return kv_dtype in _SCALED


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class KVLayout:
    """Geometry and format of one KV pool (one TP rank)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    kv_dtype: KVDtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_pages"):
            _check_positive_int(name, getattr(self, name))
        _check_kv_dtype(self.kv_dtype)

    @property
    def scaled(self) -> bool:
        return self.kv_dtype in _SCALED

    @property
    def payload_dtype(self) -> torch.dtype:
        return _PAYLOAD_DTYPES[self.kv_dtype]

    @property
    def payload_bytes(self) -> int:
        """Bytes of one payload element."""
        return self.payload_dtype.itemsize

    @property
    def payload_shape(self) -> tuple[int, int, int, int, int, int]:
        return (2, self.num_layers, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def scales_shape(self) -> tuple[int, int, int, int, int] | None:
        if not self.scaled:
            return None
        return (2, self.num_layers, self.num_pages, self.page_size, self.num_kv_heads)

    @property
    def payload_strides(self) -> tuple[int, ...]:
        return _contiguous_strides(self.payload_shape)

    @property
    def scales_strides(self) -> tuple[int, ...] | None:
        shape = self.scales_shape
        return None if shape is None else _contiguous_strides(shape)

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.page_bytes * self.num_pages

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def with_num_pages(self, num_pages: int) -> KVLayout:
        """Same format and geometry, another page count (e.g. the CPU swap pool)."""
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size, num_pages,
                        self.kv_dtype)

    def same_page_format(self, other: KVLayout) -> bool:
        """True when whole pages can move between pools of these two layouts (page counts may differ)."""
        return (self.num_layers, self.num_kv_heads, self.head_dim, self.page_size, self.kv_dtype) == (
            other.num_layers, other.num_kv_heads, other.head_dim, other.page_size, other.kv_dtype)


def _check_index(name: str, value: int, bound: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < bound:
        raise IndexError(f"{name}={value!r} out of range [0, {bound})")


def payload_offset(layout: KVLayout, kv: int, layer: int, page: int, slot: int, head: int, dim: int = 0) -> int:
    """Element offset of payload[kv, layer, page, slot, head, dim] in the flattened payload (a Python int)."""
    index = (kv, layer, page, slot, head, dim)
    for name, value, bound in zip(("kv", "layer", "page", "slot", "head", "dim"), index, layout.payload_shape,
                                  strict=True):
        _check_index(name, value, bound)
    return sum(i * s for i, s in zip(index, layout.payload_strides, strict=True))


def scale_offset(layout: KVLayout, kv: int, layer: int, page: int, slot: int, head: int) -> int:
    """Element offset of scales[kv, layer, page, slot, head] in the flattened scales (a Python int)."""
    shape, strides = layout.scales_shape, layout.scales_strides
    if shape is None or strides is None:
        raise ValueError(f"kv_dtype {layout.kv_dtype!r} has no scales")
    index = (kv, layer, page, slot, head)
    for name, value, bound in zip(("kv", "layer", "page", "slot", "head"), index, shape, strict=True):
        _check_index(name, value, bound)
    return sum(i * s for i, s in zip(index, strides, strict=True))


# ----------------------------------------------------------------------------------------------- capacity


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: KVDtype) -> int:
    """2 (K and V) * L * H_kv * (D * payload_bytes + 4 if scaled): scales are counted."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        _check_positive_int(name, value)
    _check_kv_dtype(kv_dtype)
    per_head = head_dim * _PAYLOAD_DTYPES[kv_dtype].itemsize + (SCALE_BYTES if kv_dtype in _SCALED else 0)
    return 2 * num_layers * num_kv_heads * per_head


def pages_in_budget(budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                    kv_dtype: KVDtype) -> int:
    """Whole pages that fit in `budget_bytes` (floor)."""
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
    _check_positive_int("page_size", page_size)
    page_bytes = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_dtype) * page_size
    return budget_bytes // page_bytes


def tokens_per_gib(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: KVDtype) -> float:
    """KV tokens per GiB of pool memory (scales counted, no page rounding): the W6 figure."""
    return GIB / kv_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_dtype)


@dataclass(frozen=True)
class CapacityRow:
    """One row of the capacity table: a labelled pool layout (its arithmetic is the layout's)."""

    label: str
    layout: KVLayout

    @property
    def kv_dtype(self) -> KVDtype:
        return self.layout.kv_dtype

    @property
    def pages(self) -> int:
        return self.layout.num_pages

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token

    @property
    def tokens(self) -> int:
        return self.layout.num_slots

    @property
    def total_bytes(self) -> int:
        return self.layout.total_bytes

    @property
    def mib(self) -> float:
        return self.total_bytes / MIB

    @property
    def tokens_str(self) -> str:
        return f"{self.tokens:,}"

    @property
    def mib_str(self) -> str:
        # Python formats the exact binary value with round-half-even: 2097.5625 -> "2,097.562".
        return f"{self.mib:,.3f}"


def capacity_table(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                   budget_bytes: int = 4 * GIB) -> list[CapacityRow]:
    """BF16 in the budget; scaled FP8 at the BF16 capacity; scaled FP8 filling the budget."""
    bf16_pages = pages_in_budget(budget_bytes, num_layers, num_kv_heads, head_dim, page_size, "bf16")
    fp8_pages = pages_in_budget(budget_bytes, num_layers, num_kv_heads, head_dim, page_size, "fp8")

    def layout(pages: int, kv_dtype: KVDtype) -> KVLayout:
        return KVLayout(num_layers, num_kv_heads, head_dim, page_size, pages, kv_dtype)

    return [
        CapacityRow("BF16", layout(bf16_pages, "bf16")),
        CapacityRow("Scaled-FP8, same capacity", layout(bf16_pages, "fp8")),
        CapacityRow(f"Scaled-FP8, ~{budget_bytes / GIB:g} GiB", layout(fp8_pages, "fp8")),
    ]


def format_capacity_table(rows: list[CapacityRow]) -> str:
    """Markdown table: format | pages | tokens | MiB | bytes/token."""
    lines = ["| KV format | pages | tokens | MiB | bytes/token |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.label} | {r.pages:,} | {r.tokens_str} | {r.mib_str} | {r.bytes_per_token:,} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ reference quantization


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec of the scaled-FP8 write: x [..., H, D] float -> (payload e4m3fn [..., H, D], scale fp32 [..., H]).

    scale = max(amax over D / 448, SCALE_EPS); payload = clamp(x / scale, -448, 448) cast to E4M3FN (round to
    nearest even). Computed in fp32. The clamp is part of the spec: fp32 rounding can push amax / scale a hair
    past 448, and what a cast does out of range differs between backends (torch saturates, a raw conversion
    can give NaN), so kernels must saturate explicitly like this. Non-finite inputs are not supported
    (the result is unspecified); every finite input gives finite payload and scale.
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize_kv expects a floating tensor, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"quantize_kv expects [..., H, D], got shape {tuple(x.shape)}")
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1)
    # Divide by a tensor, not a Python float: CUDA turns division by a host scalar into multiplication by
    # its reciprocal, which is not correctly rounded (1 ulp off), and kernels divide correctly rounded.
    scale = torch.clamp_min(amax / torch.tensor(E4M3_MAX, dtype=torch.float32, device=xf.device), SCALE_EPS)
    payload = torch.clamp(xf / scale.unsqueeze(-1), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return payload, scale


def dequantize_kv(payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Spec of the scaled-FP8 read: payload.float() * scale (fp32), then cast to `dtype`."""
    if payload.dtype != torch.float8_e4m3fn:
        raise TypeError(f"payload must be float8_e4m3fn, got {payload.dtype}")
    if scale.dtype != SCALE_DTYPE:
        raise TypeError(f"scale must be float32, got {scale.dtype}")
    if tuple(scale.shape) != tuple(payload.shape[:-1]):
        raise ValueError(f"scale shape {tuple(scale.shape)} != payload shape without D {tuple(payload.shape[:-1])}")
    return (payload.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


# ------------------------------------------------------------------------------------------------ the pool


@dataclass
class KVPool:
    """The KV pool tensors of one layout on one device. An fp8 payload is stored as float8_e4m3fn."""

    layout: KVLayout
    payload: torch.Tensor
    scales: torch.Tensor | None
    device: torch.device

    def __post_init__(self) -> None:
        lay = self.layout
        if tuple(self.payload.shape) != lay.payload_shape or self.payload.dtype != lay.payload_dtype:
            raise ValueError(f"payload {tuple(self.payload.shape)} {self.payload.dtype} does not match layout "
                             f"{lay.payload_shape} {lay.payload_dtype}")
        if not self.payload.is_contiguous():
            raise ValueError("payload must be contiguous (offsets are computed from contiguous strides)")
        if lay.scaled:
            if self.scales is None:
                raise ValueError(f"kv_dtype {lay.kv_dtype!r} needs a scales tensor")
            if tuple(self.scales.shape) != lay.scales_shape or self.scales.dtype != SCALE_DTYPE:
                raise ValueError(f"scales {tuple(self.scales.shape)} {self.scales.dtype} do not match layout "
                                 f"{lay.scales_shape} {SCALE_DTYPE}")
            if not self.scales.is_contiguous():
                raise ValueError("scales must be contiguous")
            if self.scales.device != self.payload.device:
                raise ValueError(f"scales on {self.scales.device}, payload on {self.payload.device}")
        elif self.scales is not None:
            raise ValueError(f"kv_dtype {lay.kv_dtype!r} has no scales, got a scales tensor")
        dev = torch.device(self.device)
        if dev.type != self.payload.device.type or dev.index not in (None, self.payload.device.index):
            raise ValueError(f"payload on {self.payload.device}, pool says {self.device}")
        self.device = self.payload.device

    @classmethod
    def allocate(cls, layout: KVLayout, device: torch.device | str = "cpu", *,
                 pin_memory: bool = False) -> KVPool:
        """A zero-filled pool (zero payload bits decode to 0.0 in every format; zero scales too)."""
        dev = torch.device(device)
        payload = torch.zeros(layout.payload_shape, dtype=layout.payload_dtype, device=dev,
                              pin_memory=pin_memory)
        scales = None
        if layout.scales_shape is not None:
            scales = torch.zeros(layout.scales_shape, dtype=SCALE_DTYPE, device=dev, pin_memory=pin_memory)
        return cls(layout, payload, scales, payload.device)

    def _check_page(self, page: int) -> None:
        _check_index("page", page, self.layout.num_pages)

    def page_payload(self, page: int) -> torch.Tensor:
        """View [2, L, S, H, D] of one page's payload."""
        self._check_page(page)
        return self.payload[:, :, page]

    def page_scales(self, page: int) -> torch.Tensor | None:
        """View [2, L, S, H] of one page's scales (None for unscaled formats)."""
        self._check_page(page)
        return None if self.scales is None else self.scales[:, :, page]

    def payload_bits(self) -> torch.Tensor:
        """The payload reinterpreted as same-width integers (uint8 for fp8): for bitwise copies/compares."""
        return self.payload.view(_BITS_DTYPES[self.payload.dtype.itemsize])
