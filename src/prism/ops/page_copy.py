"""Moving KV pages and page rows: copy-prefix-rows, copy-on-write, compaction, swap.

Owns invariant 4's movement half: payload and scales ALWAYS move together (one call moves both; for the
Triton path, one launch), and every address into a pool is computed with 64-bit arithmetic. Each public
operation has a plain torch `*_reference` beside it, which is the specification of the kernel; the tests
compare them byte for byte.

Kernel view of a pool tensor: rows `[2*L, P, S*X]` (row = kv * L + layer; X = H*D for the payload, H for the
scales). The address of element `e` of page `p` in row `r` is `r * stride_row + p * stride_page + e`, computed
by `_pool_offset` in `_OFFSET_DTYPE` (int64). `_OFFSET_DTYPE` is read at every launch so a test can plant the
historical int32 bug, and `probe_copy_offsets` runs that same helper so the address math can be checked on
the real Qwen3-VL-8B geometry (offsets past 2^31) without allocating the pool.

Dispatch: Triton when the pool is on CUDA or `use_triton=True` (CPU tensors then need TRITON_INTERPRET=1 set
before import); otherwise the torch reference (the CPU engine path). A row copy of one or two pages on CUDA (a
prefix hit's tail) runs as strided torch copies of page views unless `use_triton=True`: less host time than a
launch. `swap_pages` is torch only, because a Triton kernel cannot read host memory.

Index validation runs on host copies of the indices as Python ints (one host sync per call when they are device
tensors; the transfer planner makes them on the host anyway).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from typing import Literal

import torch

from ..kv.fp8 import KVLayout, KVPool
from .dispatch import want_triton
from .host_copy import to_device

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # the `kernels` extra is optional; the torch references still work
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAVE_TRITON = False

IndexLike = torch.Tensor | Sequence[int]
PoolTensor = Literal["payload", "scales"]

_INT31 = 1 << 31
_BITS_DTYPES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Launch shape knobs (tests shrink them to exercise the split and the in-program loop on tiny pages).
_MAX_BLOCK = 4096
_MAX_SPLIT = 256
# Row copies of at most this many pages run as strided torch copies when the caller does not ask for Triton.
_VIEW_COPY_MAX_PAGES = 2

# ------------------------------------------------------------------------------------------- validation


def _index_list(name: str, x: IndexLike) -> list[int]:
    """A 1-D sequence of page ids / row counts as Python ints (a host copy of a tensor's). The checks below run on
    these: a call typically names one or two pages, and torch ops on tiny host tensors cost the step's host ~0.2 ms
    (H200 host: W2's tail copy) for what a few comparisons decide."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        return x.tolist()
    try:  # operator.index refuses floats, which int() would silently truncate
        return [operator.index(v) for v in x]
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be an integer tensor or a sequence of ints") from exc


def _check_pages(name: str, pages: list[int], num_pages: int) -> None:
    bad = [p for p in pages if not 0 <= p < num_pages]
    if bad:
        raise ValueError(f"{name} out of range [0, {num_pages}): {bad[:8]}")


def _check_same_length(**named: list[int]) -> None:
    lengths = {k: len(v) for k, v in named.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"index lengths differ: {lengths}")


def _check_distinct(name: str, pages: list[int]) -> None:
    if len(set(pages)) != len(pages):
        seen: set[int] = set()
        repeated = sorted({p for p in pages if p in seen or seen.add(p)})
        raise ValueError(f"{name} must be distinct; repeated: {repeated[:8]}")


def _as_tensors(*values: list[int]) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=torch.int64) for v in values]


def _validate_row_copy(layout: KVLayout, src: IndexLike, dst: IndexLike,
                       rows: IndexLike) -> tuple[list[int], list[int], list[int]]:
    s, d, r = _index_list("src_pages", src), _index_list("dst_pages", dst), _index_list("rows", rows)
    _check_same_length(src_pages=s, dst_pages=d, rows=r)
    _check_pages("src_pages", s, layout.num_pages)
    _check_pages("dst_pages", d, layout.num_pages)
    if any(not 0 <= v <= layout.page_size for v in r):
        raise ValueError(f"rows must lie in [0, page_size={layout.page_size}], got {r[:8]}")
    _check_distinct("dst_pages", d)
    sources = set(s)
    clash = [p for p in d if p in sources]
    if clash:
        # Inside one launch the programs run in no defined order, so a page that is both read and written
        # would give a racy result: such plans must be split (or use compact_pages).
        raise ValueError(f"dst pages also used as src in the same call: {clash[:8]}")
    return s, d, r


def _validate_page_move(src_layout: KVLayout, dst_layout: KVLayout, src: IndexLike, dst: IndexLike):
    s, d = _index_list("src_pages", src), _index_list("dst_pages", dst)
    _check_same_length(src_pages=s, dst_pages=d)
    _check_pages("src_pages", s, src_layout.num_pages)
    _check_pages("dst_pages", d, dst_layout.num_pages)
    _check_distinct("dst_pages", d)
    return _as_tensors(s, d)


# ------------------------------------------------------------------------------------------- references


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Same memory as same-width integers: copies are bitwise, and fp8 needs no float8 op support."""
    return t.view(_BITS_DTYPES[t.element_size()])


def _pool_tensors(pool: KVPool) -> list[torch.Tensor]:
    tensors = [_bits(pool.payload)]
    if pool.scales is not None:
        tensors.append(_bits(pool.scales))
    return tensors


def copy_page_rows_reference(pool: KVPool, src_pages: IndexLike, dst_pages: IndexLike, rows: IndexLike) -> None:
    """Spec: for each i, slots [0, rows[i]) of page src_pages[i] -> page dst_pages[i]; K and V, every layer,
    payload and scales. dst pages distinct and disjoint from src pages (ValueError otherwise)."""
    s, d, r = _validate_row_copy(pool.layout, src_pages, dst_pages, rows)
    if not s:
        return
    dev = pool.device
    s, d, r = (to_device(t, dev) for t in _as_tensors(s, d, r))
    slot_mask = torch.arange(pool.layout.page_size, device=dev)[None, :] < r[:, None]  # [n, S]
    for t in _pool_tensors(pool):
        src_block = t.index_select(2, s)  # [2, L, n, S, ...]
        dst_block = t.index_select(2, d)
        mask = slot_mask.view((1, 1) + tuple(slot_mask.shape) + (1,) * (t.dim() - 4))
        t.index_copy_(2, d, torch.where(mask, src_block, dst_block))


def compact_pages_reference(pool: KVPool, src_pages: IndexLike, dst_pages: IndexLike) -> None:
    """Spec: whole pages src_pages[i] -> dst_pages[i] with snapshot semantics (every source read from the state
    before the call), overlap between the two sets allowed; dst pages distinct."""
    s, d = _validate_page_move(pool.layout, pool.layout, src_pages, dst_pages)
    if s.numel() == 0:
        return
    s, d = to_device(s, pool.device), to_device(d, pool.device)
    for t in _pool_tensors(pool):
        t.index_copy_(2, d, t.index_select(2, s))  # index_select materializes the snapshot


def swap_pages(src_pool: KVPool, dst_pool: KVPool, src_pages: IndexLike, dst_pages: IndexLike) -> None:
    """Whole pages src_pool[src_pages[i]] -> dst_pool[dst_pages[i]], payload and scales together, between pools
    of the same page format on any devices (GPU pool <-> CPU swap pool). Snapshot semantics even when
    src_pool is dst_pool. Torch only (index_select + index_copy_); the device->host copy is blocking."""
    if not src_pool.layout.same_page_format(dst_pool.layout):
        raise ValueError(f"pools differ in page format: {src_pool.layout} vs {dst_pool.layout}")
    s, d = _validate_page_move(src_pool.layout, dst_pool.layout, src_pages, dst_pages)
    if s.numel() == 0:
        return
    s, d = to_device(s, src_pool.device), to_device(d, dst_pool.device)
    for src_t, dst_t in zip(_pool_tensors(src_pool), _pool_tensors(dst_pool), strict=True):
        block = src_t.index_select(2, s).to(dst_pool.device)
        dst_t.index_copy_(2, d, block)


# ---------------------------------------------------------------------------------------------- Triton


def row_view_geometry(layout: KVLayout, tensor: PoolTensor = "payload") -> tuple[int, int, int]:
    """(stride_row, stride_page, elems_per_slot) of a pool tensor viewed as rows [2*L, P, S*X], in elements."""
    if tensor not in ("payload", "scales"):
        raise ValueError(f"tensor must be 'payload' or 'scales', got {tensor!r}")
    if tensor == "scales" and not layout.scaled:
        raise ValueError(f"kv_dtype {layout.kv_dtype!r} has no scales")
    x = layout.num_kv_heads * layout.head_dim if tensor == "payload" else layout.num_kv_heads
    stride_page = layout.page_size * x
    return layout.num_pages * stride_page, stride_page, x


if HAVE_TRITON:
    _OFFSET_DTYPE = tl.int64

    @triton.jit
    def _pool_offset(row, page, elem, stride_row, stride_page, OFFSET_DTYPE: tl.constexpr):
        # The one address formula of every page kernel. With OFFSET_DTYPE = int32 the products wrap past 2^31.
        return tl.cast(row, OFFSET_DTYPE) * stride_row + tl.cast(page, OFFSET_DTYPE) * stride_page + tl.cast(elem, OFFSET_DTYPE)

    @triton.jit
    def _copy_row_span(src_ptr, dst_ptr, row, src_page, dst_page, n_elems,
                       s_row, s_page, d_row, d_page, split, nsplit,
                       BLOCK: tl.constexpr, OFFSET_DTYPE: tl.constexpr):
        for start in range(split * BLOCK, n_elems, nsplit * BLOCK):
            elem = start + tl.arange(0, BLOCK)
            mask = elem < n_elems
            v = tl.load(src_ptr + _pool_offset(row, src_page, elem, s_row, s_page, OFFSET_DTYPE), mask=mask)
            tl.store(dst_ptr + _pool_offset(row, dst_page, elem, d_row, d_page, OFFSET_DTYPE), v, mask=mask)

    @triton.jit
    def _copy_page_rows_kernel(
        src_pay, dst_pay, src_sc, dst_sc, src_pages_ptr, dst_pages_ptr, rows_ptr,
        s_pay_row, s_pay_page, d_pay_row, d_pay_page,
        s_sc_row, s_sc_page, d_sc_row, d_sc_page,
        pay_per_slot, sc_per_slot,
        HAS_SCALES: tl.constexpr, BLOCK: tl.constexpr, OFFSET_DTYPE: tl.constexpr,
    ):
        # grid = (pairs, 2*L rows, splits): one program copies a strided share of one (pair, K/V layer row),
        # payload then scales, so a launch never moves one without the other.
        pair = tl.program_id(0)
        row = tl.program_id(1)
        split = tl.program_id(2)
        nsplit = tl.num_programs(2)
        src_page = tl.load(src_pages_ptr + pair)
        dst_page = tl.load(dst_pages_ptr + pair)
        nrows = tl.load(rows_ptr + pair).to(tl.int32)
        _copy_row_span(src_pay, dst_pay, row, src_page, dst_page, nrows * pay_per_slot,
                       s_pay_row, s_pay_page, d_pay_row, d_pay_page, split, nsplit, BLOCK, OFFSET_DTYPE)
        if HAS_SCALES:
            _copy_row_span(src_sc, dst_sc, row, src_page, dst_page, nrows * sc_per_slot,
                           s_sc_row, s_sc_page, d_sc_row, d_sc_page, split, nsplit, BLOCK, OFFSET_DTYPE)

    @triton.jit
    def _probe_offsets_kernel(rows_ptr, pages_ptr, slots_ptr, out_ptr, n, stride_row, stride_page, per_slot,
                              BLOCK: tl.constexpr, OFFSET_DTYPE: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        row = tl.load(rows_ptr + i, mask=mask, other=0)
        page = tl.load(pages_ptr + i, mask=mask, other=0)
        # as in the copy kernel: the within-page element index is int32 (checked < 2^31 on the host)
        elem = tl.load(slots_ptr + i, mask=mask, other=0).to(tl.int32) * per_slot
        off = _pool_offset(row, page, elem, stride_row, stride_page, OFFSET_DTYPE)
        tl.store(out_ptr + i, off.to(tl.int64), mask=mask)

    _INTERPRETED = type(_copy_page_rows_kernel).__name__ == "InterpretedFunction"
else:
    _OFFSET_DTYPE = None
    _INTERPRETED = False


def _want_triton(device: torch.device, use_triton: bool | None) -> bool:
    return want_triton(device, use_triton, have_triton=HAVE_TRITON, interpreted=_INTERPRETED)


def _row_views(t: torch.Tensor, num_rows: int) -> torch.Tensor:
    # [2, L, P, S, ...] -> [2L, P, S*X] as bits; contiguous pools make this a view.
    return _bits(t).view(num_rows, t.shape[2], -1)


def _launch_copy(src_pay: torch.Tensor, dst_pay: torch.Tensor, src_sc: torch.Tensor | None,
                 dst_sc: torch.Tensor | None, src_idx: torch.Tensor, dst_idx: torch.Tensor, rows: torch.Tensor,
                 layout: KVLayout) -> None:
    """Row copy between two pool-shaped tensor sets (same per-page geometry, any page counts)."""
    num_rows = 2 * layout.num_layers
    pay_per_slot = layout.num_kv_heads * layout.head_dim
    page_elems = layout.page_size * pay_per_slot
    if page_elems >= _INT31:
        raise ValueError(f"one page row holds {page_elems} elements; in-page indices must stay below 2^31")
    sp, dp = _row_views(src_pay, num_rows), _row_views(dst_pay, num_rows)
    has_scales = src_sc is not None
    if has_scales:
        assert dst_sc is not None
        ss, ds = _row_views(src_sc, num_rows), _row_views(dst_sc, num_rows)
    else:
        ss, ds = sp, dp  # unused placeholders (HAS_SCALES=False)
    block = min(_MAX_BLOCK, triton.next_power_of_2(page_elems))
    nsplit = min(_MAX_SPLIT, triton.cdiv(page_elems, block))
    grid = (src_idx.numel(), num_rows, nsplit)
    dev = dst_pay.device
    ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with ctx:
        _copy_page_rows_kernel[grid](
            sp, dp, ss, ds, src_idx, dst_idx, rows,
            sp.stride(0), sp.stride(1), dp.stride(0), dp.stride(1),
            ss.stride(0), ss.stride(1), ds.stride(0), ds.stride(1),
            pay_per_slot, layout.num_kv_heads,
            HAS_SCALES=has_scales, BLOCK=block, OFFSET_DTYPE=_OFFSET_DTYPE,
        )


def copy_page_rows(pool: KVPool, src_pages: IndexLike, dst_pages: IndexLike, rows: IndexLike, *,
                   use_triton: bool | None = None) -> None:
    """Slots [0, rows[i]) of page src_pages[i] -> page dst_pages[i] (K and V, every layer, payload and scales).

    rows[i] == page_size is a whole-page copy (copy-on-write); 0 < rows[i] < page_size copies the common
    prefix rows into a private tail page; 0 is a no-op. dst pages must be distinct and disjoint from the src
    pages (ValueError): copies inside one launch have no order. Same result as `copy_page_rows_reference`.
    """
    if not _want_triton(pool.device, use_triton):
        copy_page_rows_reference(pool, src_pages, dst_pages, rows)
        return
    s, d, r = _validate_row_copy(pool.layout, src_pages, dst_pages, rows)
    if not s:
        return
    if use_triton is None and len(s) <= _VIEW_COPY_MAX_PAGES:
        _copy_rows_by_views(pool, s, d, r)
        return
    # One upload for the three lists, each row padded to an even length: every row then starts 16-byte aligned, so
    # Triton's pointer specialization gives one kernel variant whatever the count (an odd count's rows started at 8
    # bytes and compiled a second variant mid-serving: `engine/warm_up.py`).
    n, width = len(s), len(s) + len(s) % 2
    pad = [0] * (width - n)
    index = to_device(torch.tensor([s + pad, d + pad, r + pad], dtype=torch.int64), pool.device)
    _launch_copy(pool.payload, pool.payload, pool.scales, pool.scales, index[0, :n], index[1, :n], index[2, :n],
                 pool.layout)


def _copy_rows_by_views(pool: KVPool, src: list[int], dst: list[int], rows: list[int]) -> None:
    """`copy_page_rows` for a few pages, one strided torch copy per page and pool tensor: the page ids are host
    ints, so a copy is a view of every layer's rows, and two copies cost the host less than one Triton launch
    (~0.2 ms with its argument handling on the H200 host: W2's tail copy)."""
    num_rows = 2 * pool.layout.num_layers
    for t in _pool_tensors(pool):
        view = _row_views(t, num_rows)  # [2L, P, S*X]
        per_slot = view.shape[2] // pool.layout.page_size
        for s, d, r in zip(src, dst, rows, strict=True):
            if r:
                view[:, d, : r * per_slot].copy_(view[:, s, : r * per_slot])


def compact_pages(pool: KVPool, src_pages: IndexLike, dst_pages: IndexLike, *,
                  use_triton: bool | None = None) -> None:
    """Whole pages src_pages[i] -> dst_pages[i] with snapshot semantics: the result equals reading every source
    from the state before the call, even when dst and src sets overlap (permutations, compaction after
    eviction). dst pages must be distinct; sources may repeat.

    Pairs with src == dst are no-ops and dropped. If the remaining dst set is disjoint from the src set the
    copy runs in one launch; otherwise the sources are first staged into a temporary of n pages (one launch
    pool -> temporary, one launch temporary -> pool, on the same stream, so the second reads what the first
    wrote). The temporary costs n pages of memory, transiently.
    """
    if not _want_triton(pool.device, use_triton):
        compact_pages_reference(pool, src_pages, dst_pages)
        return
    s, d = _validate_page_move(pool.layout, pool.layout, src_pages, dst_pages)
    moving = s != d
    s, d = s[moving], d[moving]
    n = s.numel()
    if n == 0:
        return
    lay, dev = pool.layout, pool.device
    full = torch.full((n,), lay.page_size, dtype=torch.int64, device=dev)
    s_dev, d_dev = s.to(dev), d.to(dev)
    if not bool(torch.isin(d, s).any()):
        _launch_copy(pool.payload, pool.payload, pool.scales, pool.scales, s_dev, d_dev, full, lay)
        return
    stage_lay = lay.with_num_pages(n)
    stage = KVPool(stage_lay, torch.empty(stage_lay.payload_shape, dtype=lay.payload_dtype, device=dev),
                   None if stage_lay.scales_shape is None
                   else torch.empty(stage_lay.scales_shape, dtype=torch.float32, device=dev), dev)
    stage_idx = torch.arange(n, dtype=torch.int64, device=dev)
    _launch_copy(pool.payload, stage.payload, pool.scales, stage.scales, s_dev, stage_idx, full, lay)
    _launch_copy(stage.payload, pool.payload, stage.scales, pool.scales, stage_idx, d_dev, full, lay)


def probe_copy_offsets(layout: KVLayout, rows: IndexLike, pages: IndexLike, slots: IndexLike, *,
                       tensor: PoolTensor = "payload", device: torch.device | str | None = None) -> torch.Tensor:
    """The element offsets the copy kernel would use for slot `slots[i]` (its first element) of page
    `pages[i]` in K/V layer row `rows[i]` (row = kv * L + layer), computed by the kernel's own `_pool_offset`
    under the current `_OFFSET_DTYPE`, from the real strides of `layout`, without allocating the pool.
    Returns int64 [n] on `device` (default: CUDA if available, else CPU, which needs TRITON_INTERPRET=1)."""
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed (install prism[kernels])")
    stride_row, stride_page, per_slot = row_view_geometry(layout, tensor)
    r, p, s = _index_list("rows", rows), _index_list("pages", pages), _index_list("slots", slots)
    _check_same_length(rows=r, pages=p, slots=s)
    _check_pages("rows", r, 2 * layout.num_layers)
    _check_pages("pages", p, layout.num_pages)
    _check_pages("slots", s, layout.page_size)
    r, p, s = _as_tensors(r, p, s)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    _want_triton(dev, True)
    n = r.numel()
    out = torch.full((n,), -1, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _probe_offsets_kernel[(triton.cdiv(n, block),)](
        r.to(dev), p.to(dev), s.to(dev), out, n, stride_row, stride_page, per_slot,
        BLOCK=block, OFFSET_DTYPE=_OFFSET_DTYPE,
    )
    return out
