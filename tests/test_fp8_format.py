"""Scaled-FP8 KV format (prism.kv.fp8): capacity arithmetic, layout/addressing, reference quantization, pool."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.kv import fp8
from prism.kv.fp8 import GIB, KVLayout, KVPool

QWEN3_VL_8B = dict(num_layers=36, num_kv_heads=8, head_dim=128)


# ------------------------------------------------------------------------------------------------ capacity


def test_bytes_per_token_qwen3_vl_8b():
    assert fp8.kv_bytes_per_token(**QWEN3_VL_8B, kv_dtype="bf16") == 147_456
    assert fp8.kv_bytes_per_token(**QWEN3_VL_8B, kv_dtype="fp8") == 76_032
    # fp16 has bf16's width; fp32 twice that; neither carries scales
    assert fp8.kv_bytes_per_token(**QWEN3_VL_8B, kv_dtype="fp16") == 147_456
    assert fp8.kv_bytes_per_token(**QWEN3_VL_8B, kv_dtype="fp32") == 2 * 147_456


def test_pages_in_4gib_budget():
    assert fp8.pages_in_budget(4 * GIB, **QWEN3_VL_8B, page_size=256, kv_dtype="bf16") == 113
    assert fp8.pages_in_budget(4 * GIB, **QWEN3_VL_8B, page_size=256, kv_dtype="fp8") == 220


def test_capacity_table_numbers_and_strings():
    rows = fp8.capacity_table(**QWEN3_VL_8B, page_size=256, budget_bytes=4 * GIB)
    got = [(r.kv_dtype, r.pages, r.tokens, r.tokens_str, r.mib_str, r.bytes_per_token) for r in rows]
    assert got == [
        ("bf16", 113, 28_928, "28,928", "4,068.000", 147_456),
        ("fp8", 113, 28_928, "28,928", "2,097.562", 76_032),
        ("fp8", 220, 56_320, "56,320", "4,083.750", 76_032),
    ]
    assert rows[1].mib == 2097.5625  # exact in binary; the string above is Python's round-half-even
    assert [r.label for r in rows] == ["BF16", "Scaled-FP8, same capacity", "Scaled-FP8, ~4 GiB"]
    # the table's bytes agree with a real layout of that many pages
    for r in rows:
        lay = KVLayout(**QWEN3_VL_8B, page_size=256, num_pages=r.pages, kv_dtype=r.kv_dtype)
        assert lay.total_bytes == r.total_bytes <= 4 * GIB


def test_format_capacity_table_markdown():
    text = fp8.format_capacity_table(fp8.capacity_table(**QWEN3_VL_8B, page_size=256))
    lines = text.strip().splitlines()
    assert lines[0].startswith("| KV format |") and set(lines[1]) <= set("|-: ")
    assert lines[2] == "| BF16 | 113 | 28,928 | 4,068.000 | 147,456 |"
    assert lines[3] == "| Scaled-FP8, same capacity | 113 | 28,928 | 2,097.562 | 76,032 |"
    assert lines[4] == "| Scaled-FP8, ~4 GiB | 220 | 56,320 | 4,083.750 | 76,032 |"
    assert len(lines) == 5


def test_tokens_per_gib_fp8_vs_bf16():
    bf16 = fp8.tokens_per_gib(**QWEN3_VL_8B, kv_dtype="bf16")
    f8 = fp8.tokens_per_gib(**QWEN3_VL_8B, kv_dtype="fp8")
    assert math.isclose(bf16, GIB / 147_456) and math.isclose(f8, GIB / 76_032)
    assert f8 / bf16 >= 1.93  # W6 target; scales counted, so below the payload-only 2x


@given(budget=st.integers(0, 1 << 40), layers=st.integers(1, 64), heads=st.integers(1, 16),
       dim=st.sampled_from([8, 64, 80, 128, 256]), page=st.integers(1, 512),
       dtype=st.sampled_from(fp8.KV_DTYPES))
def test_pages_in_budget_is_floor(budget, layers, heads, dim, page, dtype):
    n = fp8.pages_in_budget(budget, layers, heads, dim, page, dtype)
    page_bytes = fp8.kv_bytes_per_token(layers, heads, dim, dtype) * page
    assert n * page_bytes <= budget < (n + 1) * page_bytes


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_capacity_bad_args(bad):
    with pytest.raises(ValueError, match="num_kv_heads"):
        fp8.kv_bytes_per_token(36, bad, 128, "fp8")
    with pytest.raises(ValueError, match="kv_dtype"):
        fp8.kv_bytes_per_token(36, 8, 128, "int4")
    with pytest.raises(ValueError, match="budget_bytes"):
        fp8.pages_in_budget(-5, 36, 8, 128, 256, "fp8")


# -------------------------------------------------------------------------------------- layout, offsets


@pytest.mark.parametrize("kv_dtype", fp8.KV_DTYPES)
def test_layout_shapes_and_bytes_match_real_tensors(kv_dtype):
    lay = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, page_size=4, num_pages=5, kv_dtype=kv_dtype)
    pool = KVPool.allocate(lay)
    assert pool.payload.shape == lay.payload_shape == (2, 2, 5, 4, 3, 8)
    assert pool.payload.dtype == lay.payload_dtype
    nbytes = pool.payload.numel() * pool.payload.element_size()
    if kv_dtype == "fp8":
        assert pool.payload.dtype == torch.float8_e4m3fn
        assert pool.scales is not None and pool.scales.shape == lay.scales_shape == (2, 2, 5, 4, 3)
        assert pool.scales.dtype == torch.float32
        nbytes += pool.scales.numel() * 4
    else:
        assert pool.scales is None and lay.scales_shape is None
    assert lay.num_slots == 20
    assert nbytes == lay.total_bytes == lay.page_bytes * 5 == lay.bytes_per_token * lay.num_slots


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "page_size", "num_pages"])
@pytest.mark.parametrize("bad", [0, -3, 2.0, False])
def test_layout_rejects_bad_sizes(field, bad):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, num_pages=3, kv_dtype="fp8")
    args[field] = bad
    with pytest.raises(ValueError, match=field):
        KVLayout(**args)


def test_layout_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="kv_dtype"):
        KVLayout(2, 2, 8, 4, 3, "e5m2")


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32"])
def test_offsets_address_the_real_elements(kv_dtype):
    lay = KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, page_size=5, num_pages=3, kv_dtype=kv_dtype)
    # a pool whose every element holds its own flat index (as fp32, exact below 2^24)
    payload = torch.arange(math.prod(lay.payload_shape), dtype=torch.float32).view(lay.payload_shape)
    scales = torch.arange(math.prod(lay.scales_shape or (0,)), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        idx = [int(torch.randint(0, n, (1,), generator=g)) for n in lay.payload_shape]
        assert fp8.payload_offset(lay, *idx) == int(payload[tuple(idx)])
        if lay.scaled:
            assert fp8.scale_offset(lay, *idx[:5]) == int(scales.view(lay.scales_shape)[tuple(idx[:5])])
    if not lay.scaled:
        with pytest.raises(ValueError, match="no scales"):
            fp8.scale_offset(lay, 0, 0, 0, 0, 0)


def test_offsets_qwen3_vl_8b_past_int32():
    lay = KVLayout(**QWEN3_VL_8B, page_size=256, num_pages=220, kv_dtype="fp8")
    assert lay.payload_strides[:2] == (36 * 57_671_680, 57_671_680)
    # K/V layer row 38 = V of layer 2
    off = fp8.payload_offset(lay, 1, 2, 0, 0, 0)
    assert off == 38 * 57_671_680 == 2_191_523_840 > 2**31 - 1
    last = fp8.payload_offset(lay, 1, 35, 219, 255, 7, 127)
    assert last == math.prod(lay.payload_shape) - 1 > 2**31
    assert fp8.scale_offset(lay, 1, 35, 219, 255, 7) == math.prod(lay.scales_shape) - 1


@pytest.mark.parametrize("idx", [(2, 0, 0, 0, 0), (0, 0, 3, 0, 0), (0, 0, 0, 0, -1), (0, 0, 0, 4, 0)])
def test_offsets_reject_out_of_range(idx):
    lay = KVLayout(1, 1, 8, 4, 3, "fp8")
    with pytest.raises(IndexError, match="out of range"):
        fp8.payload_offset(lay, *idx)
    with pytest.raises(IndexError, match="out of range"):
        fp8.scale_offset(lay, *idx)


# ------------------------------------------------------------------------------------------ quantization

_finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
_shape = st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 16))


@st.composite
def _kv_tensor(draw):
    shape = draw(_shape)
    n = math.prod(shape)
    kind = draw(st.sampled_from(["any", "unit", "zero_rows", "huge"]))
    if kind == "unit":
        vals = draw(st.lists(st.floats(-4, 4, width=32), min_size=n, max_size=n))
    elif kind == "huge":
        vals = draw(st.lists(st.sampled_from([3.0e38, -3.4e38, 1e30, 0.0, -1.0, 1e-30]), min_size=n,
                             max_size=n))
    else:
        vals = draw(st.lists(_finite32, min_size=n, max_size=n))
    x = torch.tensor(vals, dtype=torch.float32).view(shape)
    if kind == "zero_rows":
        x[..., ::2, :] = 0.0
    return x


def _roundtrip_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # E4M3: 3 mantissa bits -> normal values (|y| >= 2^-6) round with relative error <= 2^-4; subnormals
    # have step 2^-9, so absolute error <= 2^-10 in scaled units. Plus fp32 slack for the divide/multiply.
    s = scale.unsqueeze(-1)
    return 2.0**-4 * x.abs() + s * 2.0**-10 + 2.0**-20 * x.abs().amax(-1, keepdim=True)


@settings(max_examples=150)
@given(_kv_tensor())
def test_quantize_roundtrip_properties(x):
    payload, scale = fp8.quantize_kv(x)
    assert payload.dtype == torch.float8_e4m3fn and payload.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    pf = payload.float()
    assert torch.isfinite(pf).all() and torch.isfinite(scale).all()
    assert (scale >= fp8.SCALE_EPS).all() and (pf.abs() <= fp8.E4M3_MAX).all()
    amax = x.abs().amax(-1)
    assert torch.equal(scale, torch.clamp_min(amax / fp8.E4M3_MAX, fp8.SCALE_EPS))
    # rows not floored by eps use the whole E4M3 range: their largest element maps to +-448
    full = amax >= fp8.E4M3_MAX * fp8.SCALE_EPS
    assert torch.equal(pf.abs().amax(-1)[full], torch.full_like(amax[full], fp8.E4M3_MAX))
    x_hat = fp8.dequantize_kv(payload, scale, torch.float32)
    assert torch.isfinite(x_hat).all()
    assert ((x_hat - x).abs() <= _roundtrip_bound(x, scale)).all()
    assert (x_hat[x == 0] == 0).all() and (pf[x == 0] == 0).all()
    assert (torch.sign(x_hat) * torch.sign(x) >= 0).all()  # never flips sign


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_dtypes_and_zero_rows(dtype):
    x = torch.zeros(2, 3, 8, dtype=dtype)
    x[1, 2] = torch.linspace(-2, 3, 8, dtype=dtype)
    payload, scale = fp8.quantize_kv(x)
    assert torch.equal(scale[0], torch.full((3,), fp8.SCALE_EPS))
    assert (payload[0].float() == 0).all() and (payload[1, :2].float() == 0).all()
    assert scale[1, 2] == pytest.approx(3.0 / 448)
    out = fp8.dequantize_kv(payload, scale, dtype)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.allclose(out.float(), x.float(), atol=3 * 2.0**-4, rtol=0)


def test_quantize_dequantize_bad_input():
    with pytest.raises(TypeError, match="floating"):
        fp8.quantize_kv(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[\.\.\., H, D\]"):
        fp8.quantize_kv(torch.ones(4))
    p, s = fp8.quantize_kv(torch.randn(2, 3, 8))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8.dequantize_kv(p.float(), s)
    with pytest.raises(TypeError, match="float32"):
        fp8.dequantize_kv(p, s.double())
    with pytest.raises(ValueError, match="scale shape"):
        fp8.dequantize_kv(p, s[:, :2])


# ---------------------------------------------------------------------------------------------------- pool


def test_pool_page_views_alias_the_pool():
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, num_pages=3, kv_dtype="fp8")
    pool = KVPool.allocate(lay, "cpu")
    assert pool.device == torch.device("cpu")
    assert pool.page_payload(1).shape == (2, 2, 4, 2, 8) and pool.page_scales(1).shape == (2, 2, 4, 2)
    pool.page_payload(1).view(torch.uint8).fill_(0x38)  # 0x38 is 1.0 in E4M3FN
    pool.page_scales(1).fill_(2.5)
    assert (pool.payload[:, :, 1].float() == 1.0).all() and (pool.scales[:, :, 1] == 2.5).all()
    assert (pool.payload[:, :, [0, 2]].float() == 0).all() and (pool.scales[:, :, [0, 2]] == 0).all()
    assert pool.payload_bits().dtype == torch.uint8
    with pytest.raises(IndexError, match="page"):
        pool.page_payload(3)
    bf = KVPool.allocate(KVLayout(2, 2, 8, 4, 3, "bf16"))
    assert bf.page_scales(0) is None and bf.payload_bits().dtype == torch.int16


def test_pool_rejects_inconsistent_tensors():
    lay = KVLayout(1, 2, 8, 4, 3, "fp8")
    good = KVPool.allocate(lay)
    with pytest.raises(ValueError, match="needs a scales"):
        KVPool(lay, good.payload, None, good.device)
    with pytest.raises(ValueError, match="does not match"):
        KVPool(lay, good.payload.view(torch.uint8), good.scales, good.device)
    with pytest.raises(ValueError, match="do not match"):
        KVPool(lay, good.payload, good.scales[:, :, :2], good.device)
    with pytest.raises(ValueError, match="no scales"):
        KVPool(KVLayout(1, 2, 8, 4, 3, "fp16"), torch.zeros(lay.payload_shape, dtype=torch.float16),
               good.scales, good.device)
    with pytest.raises(ValueError, match="contiguous"):
        t = torch.zeros((2, 1, 4, 3, 2, 8), dtype=torch.float8_e4m3fn).transpose(2, 3)
        KVPool(lay, t, good.scales, good.device)
