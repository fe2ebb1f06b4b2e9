"""KV page movement (prism.ops.page_copy): Triton kernels vs torch references, snapshot semantics, payload and
scales moving together, 64-bit addressing (invariant 4), bad input.

Without a GPU, Triton runs on CPU tensors through its interpreter: the root conftest sets
TRITON_INTERPRET=1 before anything imports triton (never on a CUDA machine, where the kernels compile).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.kv import fp8
from prism.kv.fp8 import KVLayout, KVPool
from prism.ops import page_copy as pc

pytestmark = pytest.mark.filterwarnings(
    # the Triton interpreter turns 1-element arrays into loop bounds; numpy deprecates that (not our code)
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

TRITON_OK = pc.HAVE_TRITON and (pc._INTERPRETED or torch.cuda.is_available())
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1 at import")
IMPLS = [pytest.param(False, id="reference"), pytest.param(True, id="triton", marks=needs_triton)]
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QWEN_FP8 = KVLayout(num_layers=36, num_kv_heads=8, head_dim=128, page_size=256, num_pages=220, kv_dtype="fp8")


# ----------------------------------------------------------------------------------------------- helpers


def random_pool(lay: KVLayout, seed: int, device: str = "cpu") -> KVPool:
    """Random bits everywhere (NaN patterns included: copies must be bitwise, never arithmetic)."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool.allocate(lay, device)
    bits = pool.payload_bits()
    info = torch.iinfo(bits.dtype)
    bits.copy_(torch.randint(info.min, info.max, bits.shape, generator=g, dtype=bits.dtype))
    if pool.scales is not None:
        pool.scales.copy_(torch.rand(pool.scales.shape, generator=g) * 10)
    return pool


def clone_pool(pool: KVPool) -> KVPool:
    sc = None if pool.scales is None else pool.scales.clone()
    return KVPool(pool.layout, pool.payload.clone(), sc, pool.device)


def bits(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor | None]:
    sc = None if pool.scales is None else pool.scales.view(torch.int32).cpu()
    return pool.payload_bits().cpu(), sc


def assert_pools_identical(a: KVPool, b: KVPool) -> None:
    (pa, sa), (pb, sb) = bits(a), bits(b)
    assert torch.equal(pa, pb), "payload bits differ"
    assert (sa is None) == (sb is None)
    if sa is not None:
        assert torch.equal(sa, sb), "scale bits differ"


def oracle_row_copy(before: KVPool, src, dst, rows) -> KVPool:
    """Per-pair, per-slot loop straight from the definition; independent of both implementations."""
    out = clone_pool(before)
    ob, bb = bits(out), bits(before)
    for s, d, r in zip(src, dst, rows, strict=True):
        for t_out, t_before in zip(ob, bb, strict=True):
            if t_out is not None:
                t_out[:, :, d, :r] = t_before[:, :, s, :r]
    return out


def layouts(dtypes=("fp8", "fp16", "bf16", "fp32")):
    return st.builds(KVLayout, num_layers=st.integers(1, 3), num_kv_heads=st.integers(1, 4),
                     head_dim=st.integers(8, 32), page_size=st.integers(1, 16), num_pages=st.integers(2, 9),
                     kv_dtype=st.sampled_from(dtypes))


@st.composite
def row_copy_case(draw):
    lay = draw(layouts())
    perm = draw(st.permutations(range(lay.num_pages)))
    n = draw(st.integers(1, lay.num_pages // 2))
    dst = list(perm[:n])
    others = list(perm[n:])
    src = [draw(st.sampled_from(others)) for _ in range(n)]  # sources may repeat (fan-out)
    rows = [draw(st.integers(0, lay.page_size)) for _ in range(n)]
    return lay, src, dst, rows, draw(st.integers(0, 2**31))


# -------------------------------------------------------------------------------------------- row copies


@pytest.mark.parametrize("impl", ["reference", "views"])
@settings(max_examples=60)
@given(case=row_copy_case())
def test_copy_page_rows_reference_matches_oracle(impl, case):
    """"views": the few-page path (`_copy_rows_by_views`, what a CUDA pool takes for a prefix hit's tail)."""
    lay, src, dst, rows, seed = case
    before = random_pool(lay, seed)
    pool = clone_pool(before)
    if impl == "views":
        pc._copy_rows_by_views(pool, src, dst, rows)
    else:
        pc.copy_page_rows(pool, torch.tensor(src), torch.tensor(dst), torch.tensor(rows), use_triton=False)
    assert_pools_identical(pool, oracle_row_copy(before, src, dst, rows))


@needs_triton
@settings(max_examples=80)
@given(case=row_copy_case(), block=st.sampled_from([4096, 256, 32]), split=st.sampled_from([256, 2]))
def test_copy_page_rows_triton_matches_reference(case, block, split):
    # small blocks/splits make one program loop over several blocks, and several programs share a row
    lay, src, dst, rows, seed = case
    before = random_pool(lay, seed, KERNEL_DEVICE)
    ref, tri = clone_pool(before), clone_pool(before)
    pc.copy_page_rows_reference(ref, src, dst, rows)
    saved = pc._MAX_BLOCK, pc._MAX_SPLIT
    pc._MAX_BLOCK, pc._MAX_SPLIT = block, split
    try:
        pc.copy_page_rows(tri, torch.tensor(src), torch.tensor(dst), torch.tensor(rows), use_triton=True)
    finally:
        pc._MAX_BLOCK, pc._MAX_SPLIT = saved
    assert_pools_identical(tri, ref)
    # pages not named as dst are untouched, bit for bit
    keep = [p for p in range(lay.num_pages) if p not in dst]
    (pt, st_), (pb, sb) = bits(tri), bits(before)
    assert torch.equal(pt[:, :, keep], pb[:, :, keep])
    if st_ is not None:
        assert torch.equal(st_[:, :, keep], sb[:, :, keep])


@needs_triton
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_whole_page_cow_and_prefix_rows_triton(kv_dtype):
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=8, num_pages=6, kv_dtype=kv_dtype)
    before = random_pool(lay, 7, KERNEL_DEVICE)
    pool = clone_pool(before)
    pc.copy_page_rows(pool, [0, 1], [4, 5], [8, 3], use_triton=True)  # CoW of page 0; 3 prefix rows of page 1
    (p, s), (b, bs) = bits(pool), bits(before)
    assert torch.equal(p[:, :, 4], b[:, :, 0])
    assert torch.equal(p[:, :, 5, :3], b[:, :, 1, :3]) and torch.equal(p[:, :, 5, 3:], b[:, :, 5, 3:])
    if s is not None:
        assert torch.equal(s[:, :, 4], bs[:, :, 0])
        assert torch.equal(s[:, :, 5, :3], bs[:, :, 1, :3]) and torch.equal(s[:, :, 5, 3:], bs[:, :, 5, 3:])


def test_dispatch_cpu_uses_reference_unless_forced(monkeypatch):
    launches = []
    monkeypatch.setattr(pc, "_launch_copy", lambda *a, **k: launches.append(a))
    lay = KVLayout(1, 1, 8, 2, 4, "fp8")
    before = random_pool(lay, 1)
    pool = clone_pool(before)
    pc.copy_page_rows(pool, [0], [1], [2])  # CPU pool, use_triton=None -> torch reference
    assert launches == [] and torch.equal(bits(pool)[0][:, :, 1], bits(before)[0][:, :, 0])
    if TRITON_OK:
        pc.copy_page_rows(pool, [0], [2], [2], use_triton=True)
        assert len(launches) == 1


# ------------------------------------------------------------------------------------------- compaction


def oracle_compact(before: KVPool, src, dst) -> KVPool:
    out = clone_pool(before)
    ob, bb = bits(out), bits(before)
    for s, d in zip(src, dst, strict=True):
        for t_out, t_before in zip(ob, bb, strict=True):
            if t_out is not None:
                t_out[:, :, d] = t_before[:, :, s]
    return out


@st.composite
def compact_case(draw):
    lay = draw(layouts(("fp8", "fp16")))
    n = draw(st.integers(1, lay.num_pages))
    dst = draw(st.permutations(range(lay.num_pages)))[:n]
    mode = draw(st.sampled_from(["permutation", "random_src", "disjoint"]))
    if mode == "permutation":  # dst set == src set: every source is also overwritten
        src = list(draw(st.permutations(dst)))
    elif mode == "random_src":  # overlap, repeated sources
        src = [draw(st.integers(0, lay.num_pages - 1)) for _ in range(n)]
    else:
        free = [p for p in range(lay.num_pages) if p not in dst] or [None]
        if free == [None]:
            src = list(draw(st.permutations(dst)))
        else:
            src = [draw(st.sampled_from(free)) for _ in range(n)]
    return lay, src, list(dst), draw(st.integers(0, 2**31))


@pytest.mark.parametrize("use_triton", IMPLS)
@settings(max_examples=50)
@given(case=compact_case())
def test_compact_pages_snapshot_semantics(use_triton, case):
    lay, src, dst, seed = case
    before = random_pool(lay, seed, KERNEL_DEVICE if use_triton else "cpu")
    pool = clone_pool(before)
    pc.compact_pages(pool, torch.tensor(src), torch.tensor(dst), use_triton=use_triton)
    assert_pools_identical(pool, oracle_compact(before, src, dst))


@pytest.mark.parametrize("use_triton", IMPLS)
def test_compact_cycle_and_swap_pairs(use_triton):
    # a 3-cycle and a 2-swap: any in-place, in-order copy would read an already overwritten page
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, num_pages=6, kv_dtype="fp8")
    before = random_pool(lay, 3, KERNEL_DEVICE if use_triton else "cpu")
    pool = clone_pool(before)
    src, dst = [0, 1, 2, 3, 4, 5], [1, 2, 0, 4, 3, 5]
    pc.compact_pages(pool, src, dst, use_triton=use_triton)
    assert_pools_identical(pool, oracle_compact(before, src, dst))


# ------------------------------------------------------------------------------------------------- swap


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_swap_between_pools_of_different_sizes(kv_dtype):
    gpu_like = random_pool(KVLayout(2, 2, 8, 4, 5, kv_dtype), 11)
    cpu_swap = random_pool(gpu_like.layout.with_num_pages(9), 12)
    g0, c0 = clone_pool(gpu_like), clone_pool(cpu_swap)
    pc.swap_pages(gpu_like, cpu_swap, [4, 0, 2], [8, 1, 5])  # swap out
    (cp, cs), (gp, gs) = bits(cpu_swap), bits(g0)
    for s, d in [(4, 8), (0, 1), (2, 5)]:
        assert torch.equal(cp[:, :, d], gp[:, :, s])
        if cs is not None:
            assert torch.equal(cs[:, :, d], gs[:, :, s])
    untouched = [0, 2, 3, 4, 6, 7]
    assert torch.equal(cp[:, :, untouched], bits(c0)[0][:, :, untouched])
    assert_pools_identical(gpu_like, g0)  # the source pool is only read
    pc.swap_pages(cpu_swap, gpu_like, [8, 1], [1, 3])  # swap in
    assert torch.equal(bits(gpu_like)[0][:, :, 1], gp[:, :, 4])
    assert torch.equal(bits(gpu_like)[0][:, :, 3], gp[:, :, 0])


def test_swap_within_one_pool_is_snapshot():
    pool = random_pool(KVLayout(1, 2, 8, 4, 4, "fp8"), 5)
    before = clone_pool(pool)
    pc.swap_pages(pool, pool, [0, 1], [1, 0])
    assert_pools_identical(pool, oracle_compact(before, [0, 1], [1, 0]))


def test_swap_rejects_other_format():
    a = KVPool.allocate(KVLayout(1, 2, 8, 4, 4, "fp8"))
    for other in (KVLayout(1, 2, 8, 4, 4, "bf16"), KVLayout(1, 2, 8, 2, 8, "fp8"), KVLayout(2, 2, 8, 4, 4, "fp8")):
        with pytest.raises(ValueError, match="page format"):
            pc.swap_pages(a, KVPool.allocate(other), [0], [0])
    with pytest.raises(ValueError, match="dst_pages out of range"):
        pc.swap_pages(a, KVPool.allocate(a.layout.with_num_pages(2)), [3], [2])


# ----------------------------------------------------------------------- payload and scales move together


def tag_pool(pool: KVPool) -> None:
    """Every (K/V, layer, page, slot, head) carries the tag page+1 in all its payload bits and in its scale."""
    lay = pool.layout
    tags = torch.arange(1, lay.num_pages + 1, dtype=torch.int32).view(1, 1, -1, 1, 1)
    pool.payload_bits().copy_(tags.unsqueeze(-1).expand(lay.payload_shape).to(pool.payload_bits().dtype))
    pool.scales.copy_(tags.expand(lay.scales_shape).float())


def tag_mismatches(pool: KVPool) -> list[tuple[int, int]]:
    """(page, slot) pairs whose payload tags disagree with their scale tags (or among themselves)."""
    p = pool.payload_bits().cpu().to(torch.int64)
    s = pool.scales.cpu().to(torch.int64)
    ok = (p == s.unsqueeze(-1)).all(-1).all(-1).all(1).all(0)  # -> [P, S]
    return [tuple(x) for x in (~ok).nonzero().tolist()]


def _payload_only_copy(pool: KVPool, src, dst, rows) -> None:
    """Planted bug: moves the payload rows but forgets the scales."""
    for s, d, r in zip(src, dst, rows, strict=True):
        pool.payload_bits()[:, :, d, :r] = pool.payload_bits()[:, :, s, :r]


def _triton_payload_only_copy(pool: KVPool, src, dst, rows) -> None:
    """Planted bug: the kernel launched without its scale tensors."""
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=pool.device)  # noqa: E731
    pc._launch_copy(pool.payload, pool.payload, None, None, t(src), t(dst), t(rows), pool.layout)


PLANTED = [pytest.param(_payload_only_copy, id="torch"),
           pytest.param(_triton_payload_only_copy, id="triton", marks=needs_triton)]


@pytest.mark.parametrize("use_triton", IMPLS)
def test_copies_keep_payload_and_scales_together(use_triton):
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, num_pages=8, kv_dtype="fp8")
    pool = KVPool.allocate(lay, KERNEL_DEVICE if use_triton else "cpu")
    tag_pool(pool)
    assert tag_mismatches(pool) == []
    pc.copy_page_rows(pool, [0, 1, 1], [5, 6, 7], [4, 2, 1], use_triton=use_triton)
    pc.compact_pages(pool, [5, 6, 7, 2], [2, 5, 6, 7], use_triton=use_triton)
    swap = KVPool.allocate(lay.with_num_pages(3))
    pc.swap_pages(pool, swap, [2, 5], [0, 2])
    pc.swap_pages(swap, pool, [2, 0], [3, 4])
    assert tag_mismatches(pool) == [] and tag_mismatches(swap) == []
    # tags show what moved where: page 3 now holds page 1's first 2 rows, page 4 page 0's whole page
    sc = pool.scales.cpu()
    assert sc[0, 0, 3, :, 0].tolist() == [2, 2, 7, 7] and sc[0, 0, 4, :, 0].tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize("planted", PLANTED)
def test_consistency_check_catches_payload_only_copy(planted):
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4, num_pages=4, kv_dtype="fp8")
    pool = KVPool.allocate(lay, KERNEL_DEVICE)
    tag_pool(pool)
    planted(pool, [0], [3], [2])
    assert tag_mismatches(pool) == [(3, 0), (3, 1)]


# ----------------------------------------------------------------------------------- 64-bit addressing


def _probe_triples():
    rows, pages, slots = [], [], []
    for row in range(2 * QWEN_FP8.num_layers):
        for page in (0, 1, 219):
            for slot in (0, 255):
                rows.append(row), pages.append(page), slots.append(slot)
    return rows, pages, slots


def _python_offsets(rows, pages, slots):
    L = QWEN_FP8.num_layers
    return [fp8.payload_offset(QWEN_FP8, r // L, r % L, p, s, 0) for r, p, s in zip(rows, pages, slots, strict=True)]


@needs_triton
def test_probe_offsets_exact_past_2_31():
    rows, pages, slots = _probe_triples()
    want = _python_offsets(rows, pages, slots)
    got = pc.probe_copy_offsets(QWEN_FP8, rows, pages, slots, device=KERNEL_DEVICE)
    assert got.dtype == torch.int64
    assert got.tolist() == want
    assert pc.row_view_geometry(QWEN_FP8)[0] == 57_671_680
    assert max(want) > 2**32 - 2**31 and any(o > 2**31 for o in want)
    first_big = min(r for r, o in zip(rows, want, strict=True) if o >= 2**31)
    assert first_big == 37  # row 37's last page already passes 2^31; row 38 from its first slot
    assert pc.probe_copy_offsets(QWEN_FP8, [38], [0], [0], device=KERNEL_DEVICE).tolist() == [2_191_523_840]
    # scales use the same helper with their own strides
    sc = pc.probe_copy_offsets(QWEN_FP8, [71], [219], [255], tensor="scales", device=KERNEL_DEVICE)
    assert sc.tolist() == [fp8.scale_offset(QWEN_FP8, 1, 35, 219, 255, 0)]


@needs_triton
def test_planted_int32_offsets_wrap(monkeypatch):
    """Invariant 4's historical bug: int32 offsets wrap at row 38 of the 8B pool. The probe must show it."""
    import triton.language as tl

    monkeypatch.setattr(pc, "_OFFSET_DTYPE", tl.int32)
    rows, pages, slots = _probe_triples()
    want = _python_offsets(rows, pages, slots)
    got = pc.probe_copy_offsets(QWEN_FP8, rows, pages, slots, device=KERNEL_DEVICE).tolist()
    wrapped = [((o + 2**31) % 2**32) - 2**31 for o in want]
    assert got == wrapped  # exactly the int32 wrap of the true offset
    assert got != want
    bad_rows = {r for r, g, w in zip(rows, got, want, strict=True) if g != w}
    assert 38 in bad_rows and min(bad_rows) == 37 and all(g < 0 for g, w in zip(got, want, strict=True) if g != w)
    assert pc.probe_copy_offsets(QWEN_FP8, [38], [0], [0], device=KERNEL_DEVICE).tolist() == [
        2_191_523_840 - 2**32]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_past_2_31_matches_reference():
    """The real 8B FP8 pool (~4 GiB): copies between pages whose rows lie past 2^31 elements."""
    pool = KVPool.allocate(QWEN_FP8, "cuda")
    bits_ = pool.payload_bits()
    bits_[:, :, 219].random_(0, 120)
    pool.scales[:, :, 219].uniform_(0, 1)
    ref_payload = bits_[:, :, 219, :200].clone()
    ref_scales = pool.scales[:, :, 219, :200].clone()
    pc.copy_page_rows(pool, torch.tensor([219]), torch.tensor([3]), torch.tensor([200]))
    assert torch.equal(bits_[:, :, 3, :200], ref_payload) and torch.equal(pool.scales[:, :, 3, :200], ref_scales)
    assert (bits_[:, :, 3, 200:] == 0).all() and (pool.scales[:, :, 3, 200:] == 0).all()
    pc.compact_pages(pool, torch.tensor([3, 219]), torch.tensor([219, 3]))
    assert torch.equal(bits_[:, :, 219, :200], ref_payload) and (bits_[:, :, 219, 200:] == 0).all()
    torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("use_triton", IMPLS)
@pytest.mark.parametrize(("src", "dst", "rows", "err", "msg"), [
    ([0, 1], [2], [4, 4], ValueError, "lengths differ"),
    ([0], [6], [4], ValueError, "dst_pages out of range"),
    ([-1], [2], [4], ValueError, "src_pages out of range"),
    ([0], [2], [5], ValueError, "rows must lie"),
    ([0], [2], [-1], ValueError, "rows must lie"),
    ([0], [0], [4], ValueError, "also used as src"),
    ([0, 1], [2, 1], [4, 4], ValueError, "also used as src"),
    ([0, 1], [2, 2], [4, 4], ValueError, "must be distinct"),
    (torch.tensor([0.0]), [2], [4], TypeError, "integer tensor"),
    (torch.tensor([[0]]), [2], [4], ValueError, "1-D"),
    ([0.0], [2], [4], TypeError, "sequence of ints"),
    ([0], [2], [3.7], TypeError, "sequence of ints"),
])
def test_copy_page_rows_bad_input(use_triton, src, dst, rows, err, msg):
    pool = random_pool(KVLayout(1, 1, 8, 4, 6, "fp8"), 0, KERNEL_DEVICE if use_triton else "cpu")
    before = clone_pool(pool)
    with pytest.raises(err, match=msg):
        pc.copy_page_rows(pool, src, dst, rows, use_triton=use_triton)
    assert_pools_identical(pool, before)  # nothing moved


@pytest.mark.parametrize("use_triton", IMPLS)
def test_compact_pages_bad_input(use_triton):
    pool = KVPool.allocate(KVLayout(1, 1, 8, 4, 6, "fp16"), KERNEL_DEVICE if use_triton else "cpu")
    with pytest.raises(ValueError, match="must be distinct"):
        pc.compact_pages(pool, [0, 1], [3, 3], use_triton=use_triton)
    with pytest.raises(ValueError, match="lengths differ"):
        pc.compact_pages(pool, [0, 1], [3], use_triton=use_triton)
    with pytest.raises(ValueError, match="src_pages out of range"):
        pc.compact_pages(pool, [6], [3], use_triton=use_triton)


def test_probe_bad_input():
    with pytest.raises(ValueError, match="rows out of range"):
        pc.probe_copy_offsets(QWEN_FP8, [72], [0], [0], device="cpu")
    with pytest.raises(ValueError, match="slots out of range"):
        pc.probe_copy_offsets(QWEN_FP8, [0], [0], [256], device="cpu")
    with pytest.raises(ValueError, match="no scales"):
        pc.row_view_geometry(KVLayout(1, 1, 8, 4, 6, "bf16"), "scales")


def test_dispatch_errors_are_explicit(monkeypatch):
    pool = KVPool.allocate(KVLayout(1, 1, 8, 4, 6, "fp8"))
    monkeypatch.setattr(pc, "_INTERPRETED", False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            pc.copy_page_rows(pool, [0], [1], [4], use_triton=True)
    monkeypatch.setattr(pc, "HAVE_TRITON", False)
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        pc.compact_pages(pool, [0], [1], use_triton=True)
    pc.copy_page_rows(pool, [0], [1], [4])  # CPU pool without Triton: the torch reference, no error


def launched_index_offsets(count: int, monkeypatch) -> list[int]:
    """The byte offset, modulo 16, of each index tensor `copy_page_rows` hands the Triton launch for `count` copies."""
    seen: list[int] = []

    def record(src_pay, dst_pay, src_sc, dst_sc, src_idx, dst_idx, rows, layout):
        seen.extend(t.data_ptr() % 16 for t in (src_idx, dst_idx, rows))

    monkeypatch.setattr(pc, "_launch_copy", record)
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, page_size=4, num_pages=12, kv_dtype="fp8")
    pool = KVPool.allocate(lay, KERNEL_DEVICE)
    pc.copy_page_rows(pool, list(range(count)), list(range(6, 6 + count)), [1] * count, use_triton=True)
    return seen


@needs_triton
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_copy_page_rows_hands_triton_aligned_index_rows(count, monkeypatch):
    """Triton specializes a pointer argument on its 16-byte alignment, so index rows starting 8 bytes in compiled a
    second kernel variant, the first time an odd number of tails was copied mid-serving (W5 on the H200, session 15;
    `engine/warm_up.py` compiles one variant at start): every count gets aligned rows."""
    assert launched_index_offsets(count, monkeypatch) == [0, 0, 0]


@needs_triton
def test_the_alignment_check_fails_on_unpadded_index_rows(monkeypatch):
    """Planted: the three lists uploaded as one [3, n] tensor without padding (the code before session 15)."""
    to_device = pc.to_device

    def unpadded(t, device):
        rows = t[:, : t.shape[1] - 1] if t.shape[1] % 2 == 0 and (t[:, -1] == 0).all() else t
        return to_device(rows.contiguous(), device)

    monkeypatch.setattr(pc, "to_device", unpadded)
    assert launched_index_offsets(3, monkeypatch) != [0, 0, 0]
