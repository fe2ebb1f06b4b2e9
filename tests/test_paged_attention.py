"""Paged KV write + attention (prism.ops.kv_write, prism.ops.paged_attention): the reference against a dense
causal oracle, the Triton kernels against the references, hit == miss through the cache, bad input.

Without a GPU the Triton kernels run on CPU tensors in the interpreter (the root conftest sets
TRITON_INTERPRET=1 before triton is imported).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from prism.kv import fp8
from prism.kv.fp8 import KVLayout, KVPool
from prism.model.attention import AttentionBackend
from prism.ops import kv_write as kw
from prism.ops import paged_attention as pa
from prism.ops import paged_prefill as pp
from prism.ops.attention_metadata import PagedAttentionMetadata
from prism.ops.paged_attention import PagedKVBackend

pytestmark = pytest.mark.filterwarnings(
    # the Triton interpreter turns 1-element arrays into loop bounds; numpy deprecates that (not our code)
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

TRITON_OK = kw.HAVE_TRITON and (kw._INTERPRETED or torch.cuda.is_available())
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1 at import")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton tests run


# ----------------------------------------------------------------------------------------------- helpers


def pool_bits(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor | None]:
    sc = None if pool.scales is None else pool.scales.view(torch.int32).cpu()
    return pool.payload_bits().cpu(), sc


def assert_same_bytes(a: KVPool, b: KVPool) -> None:
    (pa_, sa), (pb, sb) = pool_bits(a), pool_bits(b)
    assert torch.equal(pa_, pb), "payload bytes differ"
    assert (sa is None) == (sb is None)
    if sa is not None:
        assert torch.equal(sa, sb), "scale bytes differ"


def through_cache(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """What the pool gives back for x, in fp32 (from fp8's spec functions, not from the code under test)."""
    if kv_dtype == "fp8":
        return fp8.dequantize_kv(*fp8.quantize_kv(x))
    return x.to(fp8.payload_dtype_of(kv_dtype)).float()


def dense_oracle(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                 query_lens: list[int]) -> torch.Tensor:
    """float64 softmax(q k^T / sqrt(D)) v per sequence with a bottom-right causal mask, straight from the
    definition (K/V heads repeated for GQA here, in the oracle only)."""
    outs, start = [], 0
    for k, v, n in zip(keys, values, query_lens, strict=True):
        qq = q[start:start + n].double()
        start += n
        c = k.shape[0]
        group = qq.shape[1] // k.shape[1]
        kk, vv = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", qq, kk) / math.sqrt(qq.shape[-1])
        visible = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs)


def random_tables(rng: random.Random, num_pages: int, contexts: list[int], page_size: int) -> list[list[int]]:
    """Distinct, shuffled (non-contiguous) pages per sequence, sometimes with a spare page at the end."""
    pages = list(range(num_pages))
    rng.shuffle(pages)
    tables = []
    for c in contexts:
        n = -(-c // page_size) + rng.randint(0, 1)
        tables.append([pages.pop() for _ in range(n)])
    return tables


class Batch:
    """A step over a pool whose cached prefixes were written in earlier steps. specs: (prefix, new) per seq."""

    def __init__(self, lay: KVLayout, specs: list[tuple[int, int]], group: int, seed: int,
                 q_dtype: torch.dtype = torch.float32, device: str = "cpu"):
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        self.lay, self.specs = lay, specs
        self.contexts = [p + n for p, n in specs]
        self.query_lens = [n for _, n in specs]
        self.tables = random_tables(rng, lay.num_pages, self.contexts, lay.page_size)
        h, d = lay.num_kv_heads, lay.head_dim
        # magnitudes spread per channel so fp8 scales differ per token and head
        spread = torch.logspace(-2, 1, d)
        self.keys = [torch.randn(c, h, d, generator=g) * spread for c in self.contexts]
        self.values = [torch.randn(c, h, d, generator=g) for c in self.contexts]
        self.q = torch.randn(sum(self.query_lens), h * group, d, generator=g).to(q_dtype).to(device)
        self.pool = KVPool.allocate(lay, device)
        self.layer = lay.num_layers - 1
        cached = [i for i, (p, _) in enumerate(specs) if p > 0]
        if cached:  # the earlier step(s): prefixes are already in the pool
            pre = PagedAttentionMetadata.build([specs[i][0] for i in cached], [specs[i][0] for i in cached],
                                               [self.tables[i] for i in cached], lay.page_size, device)
            kw.write_kv_reference(self.pool, self.layer, pre.slot_mapping,
                                  torch.cat([self.keys[i][: specs[i][0]] for i in cached]).to(device),
                                  torch.cat([self.values[i][: specs[i][0]] for i in cached]).to(device))
        self.meta = PagedAttentionMetadata.build(self.query_lens, self.contexts, self.tables, lay.page_size,
                                                 device)
        self.k_new = torch.cat([k[p:] for k, (p, _) in zip(self.keys, specs, strict=True)]).to(device)
        self.v_new = torch.cat([v[p:] for v, (p, _) in zip(self.values, specs, strict=True)]).to(device)

    def oracle(self) -> torch.Tensor:
        kd = self.lay.kv_dtype
        return dense_oracle(self.q.cpu(), [through_cache(k, kd) for k in self.keys],
                            [through_cache(v, kd) for v in self.values], self.query_lens)


SCENARIOS = {
    "prefill_chunks_after_prefix": [(0, 7), (5, 6), (8, 3), (3, 9)],
    "pure_decode": [(0, 1), (6, 1), (11, 1), (16, 1)],
    "mixed": [(9, 1), (0, 10), (4, 4), (13, 1), (7, 2)],
}


# --------------------------------------------------------------------------------------------- KV write


@needs_triton
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16", "fp16", "fp32"])
def test_write_kv_triton_bytes_equal_reference(kv_dtype, x_dtype):
    lay = KVLayout(num_layers=2, num_kv_heads=3, head_dim=20, page_size=4, num_pages=7, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(3)
    n = 11
    slots = torch.randperm(lay.num_slots, generator=g)[:n]
    # magnitudes from 1e-9 to 1e3 inside one row (fp8 subnormals and saturation), an all-zero head, -0.0
    k = torch.randn(n, 3, 20, generator=g) * torch.logspace(-9, 3, 20)
    k[0, 1] = 0.0
    k[2, 0] = -0.0
    # v as a strided view (a slice of a packed qkv tensor): the kernel takes real strides
    v = torch.randn(n, 3, 2 * 20, generator=g)[:, :, 5:25] * 40
    k, v = k.to(x_dtype).to(DEV), v.to(x_dtype).to(DEV)
    kernel, ref = KVPool.allocate(lay, DEV), KVPool.allocate(lay, DEV)
    kw.write_kv(kernel, 1, slots.to(DEV), k, v, use_triton=True)
    kw.write_kv_reference(ref, 1, slots.to(DEV), k, v)
    assert_same_bytes(kernel, ref)
    # the reference is fp8.quantize_kv / a cast, placed at the slots of layer 1 only
    pay = ref.payload.view(2, 2, lay.num_slots, 3, 20).cpu()
    for kv, x in ((0, k), (1, v)):
        if kv_dtype == "fp8":
            want_p, want_s = fp8.quantize_kv(x.cpu())
            assert torch.equal(pay[kv, 1, slots].view(torch.uint8), want_p.view(torch.uint8))
            assert torch.equal(ref.scales.view(2, 2, lay.num_slots, 3)[kv, 1, slots].cpu(), want_s)
        else:
            assert torch.equal(pay[kv, 1, slots], x.cpu().to(lay.payload_dtype))
    untouched = torch.ones(lay.num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert (pool_bits(ref)[0].view(2, 2, lay.num_slots, -1)[:, 1, untouched] == 0).all()
    assert (pool_bits(ref)[0].view(2, 2, lay.num_slots, -1)[:, 0] == 0).all()


@needs_triton
def test_write_kv_fp8_rounding_ties_and_subnormals():
    """Rows whose amax is 448 get scale 1, so the payload is the E4M3FN rounding of the values themselves:
    every representable value, every midpoint (ties to even), its neighbours, subnormals, signs."""
    finite = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (finite[1:] + finite[:-1]) / 2
    up, down = torch.nextafter(mids, torch.full_like(mids, 1e9)), torch.nextafter(mids, torch.zeros_like(mids))
    vals = torch.cat([finite, mids, up, down, torch.tensor([1e-40, 2.0**-10, 447.9, 448.0])])
    vals = torch.cat([vals, -vals])
    d = 64
    vals = torch.cat([vals, torch.zeros((-len(vals)) % (d - 1))]).view(-1, d - 1)
    x = torch.cat([torch.full((vals.shape[0], 1), 448.0), vals], dim=1)[:, None, :].to(DEV)
    n = x.shape[0]
    lay = KVLayout(1, 1, d, 8, -(-n // 8), "fp8")
    kernel, ref = KVPool.allocate(lay, DEV), KVPool.allocate(lay, DEV)
    slots = torch.arange(n, device=DEV)
    kw.write_kv(kernel, 0, slots, x, -x, use_triton=True)
    kw.write_kv_reference(ref, 0, slots, x, -x)
    assert_same_bytes(kernel, ref)
    assert (ref.scales.view(2, -1)[:, :n] == 1.0).all()
    assert torch.equal(kernel.payload.view(2, -1, d)[0, :n].cpu().view(torch.uint8),
                       x[:, 0].cpu().to(torch.float8_e4m3fn).view(torch.uint8))


# ------------------------------------------------------------------------------------ reference vs oracle


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_reference_matches_dense_oracle(kv_dtype, group, scenario):
    """fp32 pool == dense attention; fp8 pool == dense attention over the dequantized K/V (1e-5)."""
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=40, kv_dtype=kv_dtype)
    seed = 100 * list(SCENARIOS).index(scenario) + 10 * group + (kv_dtype == "fp8")
    batch = Batch(lay, SCENARIOS[scenario], group, seed)
    out = PagedKVBackend(batch.pool, batch.meta).attend(batch.layer, batch.q, batch.k_new, batch.v_new)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    torch.testing.assert_close(out.double(), batch.oracle(), atol=1e-5, rtol=0)
    if kv_dtype == "fp8":  # the oracle really differs from attention over the unquantized K/V
        exact = dense_oracle(batch.q, batch.keys, batch.values, batch.query_lens)
        assert (exact - batch.oracle()).abs().max() > 1e-4


def test_reference_half_precision_q_and_pages():
    """bf16/fp16 pools and a bf16 q: the reference computes in q's dtype (looser tolerance)."""
    for kv_dtype, q_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float32), ("fp8", torch.float16)):
        lay = KVLayout(1, 2, 16, 4, 40, kv_dtype)
        batch = Batch(lay, SCENARIOS["mixed"], 2, 7, q_dtype)
        out = PagedKVBackend(batch.pool, batch.meta).attend(0, batch.q, batch.k_new, batch.v_new)
        tol = 1e-5 if q_dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.double(), batch.oracle(), atol=tol, rtol=0)


def test_attention_reads_back_through_the_cache():
    """The new tokens' own K/V are read back quantized: the output differs from attention over raw K/V."""
    lay = KVLayout(1, 2, 16, 4, 12, "fp8")
    batch = Batch(lay, [(0, 9)], 1, 5)
    out = pa.paged_attention_reference(batch.q, batch.pool, 0, batch.meta)  # nothing written yet: zeros
    assert torch.allclose(out, torch.zeros_like(out))
    kw.write_kv(batch.pool, 0, batch.meta.slot_mapping, batch.k_new, batch.v_new)
    out = pa.paged_attention_reference(batch.q, batch.pool, 0, batch.meta)
    torch.testing.assert_close(out.double(), batch.oracle(), atol=1e-5, rtol=0)
    raw = dense_oracle(batch.q, batch.keys, batch.values, batch.query_lens)
    assert (out.double() - raw).abs().max() > 1e-4


# ------------------------------------------------------------------------------------------ hit == miss


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32", "bf16"])
def test_hit_equals_miss_bitwise(kv_dtype):
    """Prefix (2 pages) written in an earlier step (hit) vs prefix and suffix in one step (miss): the
    suffix's outputs are bitwise equal, and so are the pools."""
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=16, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(11)
    prefix, suffix, group = 8, 6, 2
    total = prefix + suffix
    table = [9, 2, 14, 5]
    q = torch.randn(total, 2 * group, 16, generator=g)
    k = torch.randn(total, 2, 16, generator=g) * 3
    v = torch.randn(total, 2, 16, generator=g)
    other = ([3], 4)  # another sequence in the batch, decoding
    oq, ok_, ov = (torch.randn(1, h, 16, generator=g) for h in (2 * group, 2, 2))

    miss_pool = KVPool.allocate(lay)
    meta = PagedAttentionMetadata.build([total], [total], [table], 4)
    miss = PagedKVBackend(miss_pool, meta).attend(1, q, k, v)

    hit_pool = KVPool.allocate(lay)
    step1 = PagedAttentionMetadata.build([prefix], [prefix], [table], 4)
    first = PagedKVBackend(hit_pool, step1).attend(1, q[:prefix], k[:prefix], v[:prefix])
    step2 = PagedAttentionMetadata.build([1, suffix], [other[1], total], [other[0], table], 4)
    hit = PagedKVBackend(hit_pool, step2).attend(1, torch.cat([oq, q[prefix:]]), torch.cat([ok_, k[prefix:]]),
                                                 torch.cat([ov, v[prefix:]]))
    assert torch.equal(hit[1:], miss[prefix:])
    assert torch.equal(first, miss[:prefix])
    bits_hit, bits_miss = pool_bits(hit_pool), pool_bits(miss_pool)
    used = torch.tensor(table)
    assert torch.equal(bits_hit[0][:, :, used], bits_miss[0][:, :, used])


def test_sequence_alone_equals_in_batch():
    lay = KVLayout(1, 2, 16, 4, 40, "fp8")
    batch = Batch(lay, SCENARIOS["mixed"], 2, 21)
    kw.write_kv(batch.pool, 0, batch.meta.slot_mapping, batch.k_new, batch.v_new)
    together = pa.paged_attention_reference(batch.q, batch.pool, 0, batch.meta)
    start = 0
    for i, n in enumerate(batch.query_lens):
        alone = PagedAttentionMetadata.build([n], [batch.contexts[i]], [batch.tables[i]], lay.page_size)
        out = pa.paged_attention_reference(batch.q[start:start + n], batch.pool, 0, alone)
        assert torch.equal(out, together[start:start + n])
        start += n


# ---------------------------------------------------------------------------------------- decode kernel


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32", "bf16", "fp16"])
def test_decode_kernel_matches_reference(kv_dtype, group, num_splits):
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=40, kv_dtype=kv_dtype)
    batch = Batch(lay, SCENARIOS["pure_decode"], group, 31 + group, device=DEV)
    kw.write_kv(batch.pool, batch.layer, batch.meta.slot_mapping, batch.k_new, batch.v_new)
    for q_dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
        q = batch.q.to(q_dtype)
        ref = pa.paged_attention_reference(q, batch.pool, batch.layer, batch.meta)
        out = pa.paged_decode_attention(q, batch.pool, batch.layer, batch.meta, use_triton=True,
                                        num_splits=num_splits)
        assert out.dtype == q_dtype and out.shape == q.shape
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0)
    torch.testing.assert_close(out.double().cpu(), batch.oracle(), atol=1e-2, rtol=0)


@needs_triton
def test_decode_kernel_custom_scale_and_more_splits_than_pages():
    lay = KVLayout(1, 1, 8, 2, 16, "fp8")
    batch = Batch(lay, [(0, 1), (4, 1)], 2, 41, device=DEV)  # contexts 1 and 5; 8 splits, most empty
    kw.write_kv(batch.pool, 0, batch.meta.slot_mapping, batch.k_new, batch.v_new)
    ref = pa.paged_attention_reference(batch.q, batch.pool, 0, batch.meta, scale=0.7)
    out = pa.paged_decode_attention(batch.q, batch.pool, 0, batch.meta, 0.7, use_triton=True, num_splits=8)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@needs_triton
@pytest.mark.parametrize("native", [True, False], ids=["hardware-e4m3", "bits-by-hand"])
def test_fp8_kernels_keep_their_precision_for_small_values(native, monkeypatch):
    """Values of 1e-3 give FP8 scales near 2e-6: probability x scale, rounded to fp16 for the second dot,
    must stay clear of fp16's subnormals (a factor without the 2^8 lost an order of magnitude here). Both
    E4M3 decodings (the hardware's on sm_89+, the bits by hand on older GPUs) give the same numbers."""
    monkeypatch.setattr(pa, "native_fp8", lambda device: native)
    monkeypatch.setattr(pp, "native_fp8", lambda device: native)
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, page_size=4, num_pages=220, kv_dtype="fp8")
    batch = Batch(lay, [(500, 1), (300, 4)], 2, 5, device=DEV)
    small_v = batch.v_new * 1e-3
    kw.write_kv(batch.pool, 0, batch.meta.slot_mapping, batch.k_new, small_v)
    pre = PagedAttentionMetadata.build([500, 300], [500, 300], batch.tables, lay.page_size, DEV)
    kw.write_kv(batch.pool, 0, pre.slot_mapping, torch.cat([k[:p] for k, (p, _) in zip(batch.keys, batch.specs,
                                                                                          strict=True)]).to(DEV),
                torch.cat([v[:p] * 1e-3 for v, (p, _) in zip(batch.values, batch.specs, strict=True)]).to(DEV))
    q = batch.q.to(torch.float16)
    ref = pa.paged_attention_reference(q.float(), batch.pool, 0, batch.meta)
    for out in (pp.paged_prefill_attention(q, batch.pool, 0, batch.meta, use_triton=True),):
        rel = float((out.float() - ref).abs().max() / ref.abs().max())
        assert rel < 2e-3, f"relative error {rel:.2e}"
    decode_meta = PagedAttentionMetadata.build([1], [501], [batch.tables[0]], lay.page_size, DEV)
    out = pa.paged_decode_attention(q[:1], batch.pool, 0, decode_meta, use_triton=True, num_splits=2)
    ref = pa.paged_attention_reference(q[:1].float(), batch.pool, 0, decode_meta)
    rel = float((out.float() - ref).abs().max() / ref.abs().max())
    assert rel < 2e-3, f"decode: relative error {rel:.2e}"


# --------------------------------------------------------------------------------------- prefill kernel


@needs_triton
@pytest.mark.parametrize("scenario", list(SCENARIOS) + ["long"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32", "bf16"])
def test_prefill_kernel_matches_reference(kv_dtype, group, scenario):
    """Any step (prefill chunks after a cached prefix, decode, mixed, contexts of several key tiles and
    query blocks) through the paged prefill kernel == the reference (fp32 q: 1e-5; fp16 q: 1e-2)."""
    specs = SCENARIOS.get(scenario, [(150, 70), (0, 3), (61, 9)])
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=120, kv_dtype=kv_dtype)
    batch = Batch(lay, specs, group, 7 + group, device=DEV)
    kw.write_kv(batch.pool, batch.layer, batch.meta.slot_mapping, batch.k_new, batch.v_new)
    for q_dtype, tol, split_counts in ((torch.float32, 1e-5, (1, 3)), (torch.float16, 1e-2, (None,))):
        q = batch.q.to(q_dtype)
        ref = pa.paged_attention_reference(q, batch.pool, batch.layer, batch.meta)
        for splits in split_counts:
            out = pp.paged_prefill_attention(q, batch.pool, batch.layer, batch.meta, use_triton=True,
                                             num_splits=splits)
            assert out.dtype == q_dtype and out.shape == q.shape
            torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0)


@needs_triton
def test_prefill_kernel_rows_do_not_depend_on_the_batch():
    """With the split count fixed, a sequence alone gives bitwise the same rows as inside a batch."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, page_size=4, num_pages=60, kv_dtype="fp8")
    batch = Batch(lay, SCENARIOS["prefill_chunks_after_prefix"], 4, 23, device=DEV)
    kw.write_kv(batch.pool, 0, batch.meta.slot_mapping, batch.k_new, batch.v_new)
    together = pp.paged_prefill_attention(batch.q, batch.pool, 0, batch.meta, use_triton=True, num_splits=2)
    start = 0
    for i, n in enumerate(batch.query_lens):
        alone = PagedAttentionMetadata.build([n], [batch.contexts[i]], [batch.tables[i]], lay.page_size, DEV)
        out = pp.paged_prefill_attention(batch.q[start:start + n], batch.pool, 0, alone, use_triton=True,
                                         num_splits=2)
        assert torch.equal(out, together[start:start + n])
        start += n


@needs_triton
@pytest.mark.parametrize("knob", ["_HEAVIEST_FIRST", "_HEADS_FASTEST", "_SPLIT_MASKED"])
def test_prefill_schedule_knobs_change_no_bit(knob, monkeypatch):
    """The launch order (heaviest blocks first, heads fastest) is a schedule, not arithmetic: with each knob off
    the prefill gives bitwise the same rows. So do the unmasked leading tiles in the interpreter, which does not
    fuse multiply-adds (on CUDA they may change the last bits, see `_attend_keys`); here the check is that they
    skip only masks that keep everything (tiles wholly visible exist: prefixes longer than a 128-key tile)."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, page_size=4, num_pages=200, kv_dtype="fp8")
    batch = Batch(lay, [(300, 21), (0, 170), (120, 20), (129, 3)], 4, 31, device=DEV)
    kw.write_kv(batch.pool, 0, batch.meta.slot_mapping, batch.k_new, batch.v_new)
    for splits in (1, 2):
        default = pp.paged_prefill_attention(batch.q, batch.pool, 0, batch.meta, use_triton=True,
                                             num_splits=splits)
        monkeypatch.setattr(pp, knob, not getattr(pp, knob))
        other = pp.paged_prefill_attention(batch.q, batch.pool, 0, batch.meta, use_triton=True,
                                           num_splits=splits)
        monkeypatch.undo()
        assert torch.equal(default, other), f"{knob} changed the prefill's numbers at {splits} splits"


def test_prefill_blocks_layout(monkeypatch):
    """Packed order without `_HEAVIEST_FIRST`; with it, most keys read first (the block's last position)."""
    monkeypatch.setattr(pp, "_HEAVIEST_FIRST", False)
    blocks = pp.prefill_blocks([3, 1, 5], [3, 7, 9], 2)
    assert blocks.tolist() == [[0, 0, 0, 2], [0, 2, 2, 1], [1, 3, 6, 1], [2, 4, 4, 2], [2, 6, 6, 2], [2, 8, 8, 1]]
    assert pp.prefill_blocks([], [], 2).shape == (0, 4)
    monkeypatch.setattr(pp, "_HEAVIEST_FIRST", True)
    blocks = pp.prefill_blocks([3, 1, 5], [3, 7, 9], 2)
    assert blocks.tolist() == [[2, 8, 8, 1], [2, 6, 6, 2], [1, 3, 6, 1], [2, 4, 4, 2], [0, 2, 2, 1], [0, 0, 0, 2]]


@needs_triton
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_backend_kernel_path_follows_reference_over_steps(kv_dtype):
    """Prefill then decode steps through the backend with the kernels forced on, vs the reference backend:
    identical pool bytes every step, decode outputs within 1e-5."""
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=20, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(51)
    tables = [[7, 1, 12], [4, 18, 0, 9]]
    prompts = [3, 9]
    kernel_pool, ref_pool = KVPool.allocate(lay, DEV), KVPool.allocate(lay, DEV)
    lens = list(prompts)
    step_q = prompts
    for step in range(3):
        meta = PagedAttentionMetadata.build(step_q, lens, tables, 4, DEV)
        n = meta.num_tokens
        q, k, v = (torch.randn(n, h, 16, generator=g).to(DEV) for h in (4, 2, 2))
        assert isinstance(PagedKVBackend(kernel_pool, meta), AttentionBackend)
        for layer in range(2):
            out_k = PagedKVBackend(kernel_pool, meta, use_triton=True).attend(layer, q, k, v)
            out_r = PagedKVBackend(ref_pool, meta, use_triton=False).attend(layer, q, k, v)
            torch.testing.assert_close(out_k, out_r, atol=1e-5, rtol=0)
            if step == 0:  # prefill_kernel=False: the reference on both sides
                no_kernel = PagedKVBackend(kernel_pool, meta, use_triton=True, prefill_kernel=False)
                assert torch.equal(no_kernel.attend(layer, q, k, v), out_r)
        assert_same_bytes(kernel_pool, ref_pool)
        lens = [c + 1 for c in lens]
        step_q = [1, 1]


# --------------------------------------------------------------------------------------------- metadata


def test_metadata_build_layout():
    meta = PagedAttentionMetadata.build([2, 1], [5, 3], [[6, 2], [4, 7, 1]], 4)
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.context_lens.tolist() == [5, 3] and meta.context_lens_host == (5, 3)
    assert meta.block_table.tolist() == [[6, 2, 0], [4, 7, 1]]
    # seq 0: positions 3, 4 -> page 6 row 3, page 2 row 0; seq 1: position 2 -> page 4 row 2
    assert meta.slot_mapping.tolist() == [6 * 4 + 3, 2 * 4 + 0, 4 * 4 + 2]
    assert meta.query_lens == (2, 1) and meta.num_tokens == 3 and meta.max_page == 7
    assert not meta.is_decode and meta.max_context_len == 5
    assert all(t.dtype == torch.int64 for t in (meta.query_start_loc, meta.context_lens, meta.block_table,
                                                meta.slot_mapping))


@pytest.mark.parametrize(("args", "msg"), [
    (([1, 1], [2], [[0], [1]], 4), "lengths differ"),
    (([0], [2], [[0]], 4), "1 <= query_len <= context_len"),
    (([3], [2], [[0]], 4), "1 <= query_len <= context_len"),
    (([1], [9], [[0, 1]], 4), "cannot hold context 9"),
    (([1], [2], [[-1]], 4), "negative page id"),
    (([1, 1], [2, 2], [[3], [3]], 4), "same slot"),
    (([1.0], [2], [[0]], 4), "sequence of ints"),
    (([1], [2], [[0]], 0), "page_size"),
])
def test_metadata_build_rejects(args, msg):
    with pytest.raises(ValueError, match=msg):
        PagedAttentionMetadata.build(*args)


def test_metadata_direct_construction_is_checked():
    good = PagedAttentionMetadata.build([1], [2], [[3]], 4)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        PagedAttentionMetadata(good.query_start_loc, good.context_lens, good.block_table,
                               good.slot_mapping.int(), good.query_lens, good.context_lens_host, 4, 3)
    with pytest.raises(ValueError, match="columns"):
        PagedAttentionMetadata(good.query_start_loc, good.context_lens, good.block_table,
                               good.slot_mapping, good.query_lens, (5,), 4, 3)


def test_attention_rejects_bad_input():
    lay = KVLayout(2, 2, 8, 4, 6, "fp8")
    pool = KVPool.allocate(lay)
    meta = PagedAttentionMetadata.build([1, 1], [3, 2], [[1], [5]], 4)
    q = torch.zeros(2, 4, 8)
    cases = [
        (lambda: pa.paged_attention_reference(q[:1], pool, 0, PagedAttentionMetadata.build([1], [2], [[6]], 4)),
         ValueError, "pool has 6 pages"),
        (lambda: pa.paged_attention_reference(q[:1], pool, 0, PagedAttentionMetadata.build([1], [2], [[0]], 2)),
         ValueError, "page_size"),
        (lambda: pa.paged_attention_reference(q[:1], pool, 0, meta), ValueError, "tokens"),
        (lambda: pa.paged_attention_reference(torch.zeros(2, 3, 8), pool, 0, meta), ValueError, "multiple"),
        (lambda: pa.paged_attention_reference(torch.zeros(2, 4, 6), pool, 0, meta), ValueError, "dim"),
        (lambda: pa.paged_attention_reference(q, pool, 2, meta), IndexError, "layer"),
        (lambda: pa.paged_decode_attention(q[:1].repeat(3, 1, 1), pool, 0,
                                           PagedAttentionMetadata.build([2, 1], [3, 2], [[1], [5]], 4)),
         ValueError, "query_len == 1"),
    ]
    if TRITON_OK:
        cases.append((lambda: pa.paged_decode_attention(q, pool, 0, meta, use_triton=True, num_splits=0),
                      ValueError, "num_splits"))
    for fn, err, msg in cases:
        with pytest.raises(err, match=msg):
            fn()
    backend = PagedKVBackend(pool, meta)
    with pytest.raises(ValueError, match="multiple"):  # checked before the K/V are stored
        backend.attend(0, torch.zeros(2, 3, 8), torch.ones(2, 2, 8), torch.ones(2, 2, 8))
    assert (pool.payload_bits() == 0).all() and (pool.scales == 0).all()


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=needs_triton)])
def test_write_kv_rejects_bad_input(use_triton):
    lay = KVLayout(1, 2, 8, 4, 3, "fp8")
    pool = KVPool.allocate(lay)
    x = torch.zeros(2, 2, 8)
    cases = [
        (torch.tensor([0, 12]), x, ValueError, "out of range"),
        (torch.tensor([-1, 0]), x, ValueError, "out of range"),
        (torch.tensor([3, 3]), x, ValueError, "distinct"),
        (torch.tensor([0, 1], dtype=torch.int32), x, ValueError, "int64"),
        (torch.tensor([0, 1]), torch.zeros(2, 2, 4), ValueError, "shape"),
        (torch.tensor([0, 1]), torch.zeros(2, 2, 8, dtype=torch.int32), TypeError, "floating"),
    ]
    for slots, k, err, msg in cases:
        with pytest.raises(err, match=msg):
            kw.write_kv(pool, 0, slots, k, k, use_triton=use_triton)
    with pytest.raises(IndexError, match="layer"):
        kw.write_kv(pool, 1, torch.tensor([0, 1]), x, x, use_triton=use_triton)
    assert (pool.payload_bits() == 0).all() and (pool.scales == 0).all()  # nothing written by a rejected call


# -------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_cuda_kernels_match_references_8b_shape(kv_dtype):
    """8B-like geometry (8 KV heads, 32 query heads, head_dim 128, page 256), 2 layers. The fp8 pool has
    2,800 pages so the V row of layer 1 starts past 2^31 elements: the sequences' pages sit at the end."""
    num_pages = 2800 if kv_dtype == "fp8" else 64
    lay = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, page_size=256, num_pages=num_pages,
                   kv_dtype=kv_dtype)
    assert kv_dtype != "fp8" or (2 * lay.num_layers - 1) * lay.num_slots * 8 * 128 > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    contexts = [1, 255, 257, 3000, 1500]
    tables, next_page = [], num_pages
    for c in contexts:  # pages from the top of the pool, in reverse order (non-contiguous)
        n = -(-c // 256)
        tables.append(list(range(next_page - 1, next_page - 1 - 2 * n, -2)))
        next_page -= 2 * n
    pre = PagedAttentionMetadata.build(contexts, contexts, tables, 256, "cuda")
    n = pre.num_tokens
    k = torch.randn(n, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16) * 4
    v = torch.randn(n, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    kernel, ref = KVPool.allocate(lay, "cuda"), KVPool.allocate(lay, "cuda")
    for layer in range(2):
        kw.write_kv(kernel, layer, pre.slot_mapping, k, v)
        kw.write_kv_reference(ref, layer, pre.slot_mapping, k, v)
    torch.cuda.synchronize()
    assert torch.equal(kernel.payload_bits(), ref.payload_bits())
    assert kernel.scales is None or torch.equal(kernel.scales, ref.scales)
    del ref
    meta = PagedAttentionMetadata.build([1] * len(contexts), contexts, tables, 256, "cuda")
    # The kernel computes in fp32 whatever q's dtype; compare with the reference in fp32 on the same q values
    # (the reference in bf16 would add its own bf16 rounding), allowing the kernel's final bf16 rounding.
    for q_dtype, tol, rtol in ((torch.float32, 1e-5, 0.0), (torch.bfloat16, 1e-2, 2**-8)):
        q = torch.randn(len(contexts), 32, 128, device="cuda", generator=g).to(q_dtype)
        for layer in range(2):
            want = pa.paged_attention_reference(q.float(), kernel, layer, meta)
            for splits in (None, 1, 7):
                got = pa.paged_decode_attention(q, kernel, layer, meta, num_splits=splits)
                torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=rtol)
    # The prefill kernel on the same pool: several new tokens per sequence, all of them past 2^31 for layer 1's V.
    pre_meta = PagedAttentionMetadata.build([1, 100, 2, 300, 64], contexts, tables, 256, "cuda")
    for q_dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        q = torch.randn(pre_meta.num_tokens, 32, 128, device="cuda", generator=g).to(q_dtype)
        for layer in range(2):
            want = pa.paged_attention_reference(q.float(), kernel, layer, pre_meta)
            for splits in (None, 1, 5):
                got = pp.paged_prefill_attention(q, kernel, layer, pre_meta, num_splits=splits)
                torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)
    torch.cuda.synchronize()


@needs_triton
@pytest.mark.parametrize("page_size", [1, 4])
def test_compile_attention_variants_runs_every_split_count(page_size):
    """The engine-start warm-up launches every split count of both kernels without writing the pool."""
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, page_size=page_size, num_pages=4, kv_dtype="fp8")
    pool = KVPool.allocate(lay, DEV)
    before = pool.payload.clone()
    launches = pp.compile_attention_variants(pool, 2, torch.float32)
    assert launches == 4 + 7  # prefill splits 1..8, decode splits 1..64, powers of two
    assert torch.equal(pool.payload, before)
