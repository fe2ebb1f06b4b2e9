"""`ops/fused_decode.py`: the decode step's norm + rope + K/V write + attention + merge in one launch equals the
unfused launches bitwise, on the CPU through the interpreter and on the GPU compiled (bf16, the 8B model's heads,
~1,700-token contexts, eager and replayed from a CUDA graph with early launch on); where it does not apply it
declines and the backend runs the unfused launches. `specs/spec_fused_decode.py` draws the CPU cases."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prism.kv.fp8 import KVLayout, KVPool
from prism.ops import fused_decode
from prism.ops import kv_write as kw
from prism.ops import paged_attention as pa
from prism.ops.attention_metadata import PagedAttentionMetadata, SharedPrefix
from prism.ops.pdl import programmatic_launch
from prism.ops.qk_norm_rope_kv import qk_norm_rope_write_kv
from prism.testing.knobs import module_knobs

needs_triton = pytest.mark.skipif(not kw._INTERPRETED and not torch.cuda.is_available(),
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1 at import")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _step(contexts, *, heads=(4, 2, 16), page=4, kv_dtype="fp8", dtype=torch.float32, device="cpu", seed=0):
    """Two equal pools full of random K/V, a decode step over `contexts` on pages of its own, its q/k/v before
    norm and rope."""
    hq, hkv, d = heads
    num_pages = sum(-(-c // page) for c in contexts) + 2
    lay = KVLayout(num_layers=2, num_kv_heads=hkv, head_dim=d, page_size=page, num_pages=num_pages, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(seed)
    pools = [KVPool.allocate(lay, device) for _ in range(2)]
    slots = torch.arange(lay.num_slots, device=device)
    k_all = (torch.randn(len(slots), hkv, d, generator=g) * 3).to(device, dtype)
    v_all = torch.randn(len(slots), hkv, d, generator=g).to(device, dtype)
    for pool in pools:
        kw.write_kv(pool, 1, slots, k_all, v_all, use_triton=False)
    pages = iter(torch.randperm(num_pages, generator=g).tolist())
    tables = [[next(pages) for _ in range(-(-c // page))] for c in contexts]
    meta = PagedAttentionMetadata.build([1] * len(contexts), contexts, tables, page, device)
    n = len(contexts)
    qkv = (torch.randn(n, (hq + 2 * hkv) * d, generator=g) * 3).to(device, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
    qw, kw_ = ((torch.rand(d, generator=g) + 0.5).to(device, dtype) for _ in range(2))
    angles = torch.rand(n, d // 2, generator=g) * 6
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(device, dtype) for f in (torch.cos, torch.sin))
    return pools, meta, (q, k, v, qw, kw_, 1e-6, cos, sin)


def _unfused(pool, meta, args, num_splits=None):
    q, k, v, qw, kw_, eps, cos, sin = args
    rotated = qk_norm_rope_write_kv(q, k, v, qw, kw_, eps, cos, sin, pool, 1, meta.slot_mapping)
    return pa.paged_decode_attention(rotated, pool, 1, meta, use_triton=True, num_splits=num_splits)


def _assert_same(got, want, got_pool, want_pool):
    assert got is not None
    assert torch.equal(got_pool.payload_bits(), want_pool.payload_bits())
    assert got_pool.scales is None or torch.equal(got_pool.scales, want_pool.scales)
    err = float((got.float() - want.float()).abs().max())
    assert torch.equal(got, want), f"differs from the unfused launches by {err}"
    counters = fused_decode._COUNTERS.get(got.device)
    assert counters is None or not counters.any()


@needs_triton
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16", "fp16", "fp32"])
def test_fused_decode_equals_the_unfused_launches(kv_dtype):
    """Contexts of one key, a page's first row, a split's first key (16-key tiles, 4 splits of 16 at 64 keys)."""
    (want_pool, got_pool), meta, args = _step([1, 5, 17, 33, 64], kv_dtype=kv_dtype, dtype=torch.float16)
    with module_knobs(pa, {"_BLOCK_N": 16}):
        want = _unfused(want_pool, meta, args, num_splits=4)
        got = fused_decode.qk_norm_rope_decode_attention(*args, got_pool, 1, meta, num_splits=4)
    _assert_same(got, want, got_pool, want_pool)


@needs_triton
def test_backend_takes_the_fused_launch_for_decode_steps_only(monkeypatch: pytest.MonkeyPatch):
    """`PagedKVBackend.attend_unrotated` runs one launch for a decode step, the unfused ones for a prefill or a step
    with a shared prefix, and for a decode step the fused launch declines (here: `ENABLED` off); the same bytes."""
    calls = []
    fused = fused_decode.qk_norm_rope_decode_attention
    monkeypatch.setattr(fused_decode, "qk_norm_rope_decode_attention",
                        lambda *a, **k: calls.append(1) or fused(*a, **k))
    (want_pool, got_pool), meta, args = _step([9, 23])
    want = _unfused(want_pool, meta, args)
    got = pa.PagedKVBackend(got_pool, meta, use_triton=True).attend_unrotated(1, *args)
    assert len(calls) == 1
    _assert_same(got, want, got_pool, want_pool)

    monkeypatch.setattr(fused_decode, "ENABLED", False)
    (want_pool, got_pool), meta, args = _step([9, 23], seed=1)
    want = _unfused(want_pool, meta, args)
    assert fused(*args, got_pool, 1, meta) is None
    got = pa.PagedKVBackend(got_pool, meta, use_triton=True).attend_unrotated(1, *args)
    _assert_same(got, want, got_pool, want_pool)
    monkeypatch.setattr(fused_decode, "ENABLED", True)

    cascade = dataclasses.replace(meta, shared_prefix=SharedPrefix(torch.tensor([0, 0]), torch.tensor([0]), 1))
    assert fused(*args, got_pool, 1, cascade) is None
    prefill = PagedAttentionMetadata.build([2], [9], [[0, 1, 2]], 4)
    assert not fused_decode.takes_fused_decode(args[0][:1].expand(2, -1, -1), got_pool, prefill)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_fused_decode_on_the_gpu_in_bf16_with_8b_heads(kv_dtype, replay):
    """Compiled, where fused multiply-adds could break the equality: the 8B model's heads, contexts around W3's
    (~1,700 keys at 256-key pages) and short ones, early launch on; `replay`: both captured into one CUDA graph,
    replayed twice (the arrival counters must come back to zero between launches)."""
    (want_pool, got_pool), meta, args = _step([1700, 1, 257, 1024], heads=(32, 8, 128), page=256, kv_dtype=kv_dtype,
                                              dtype=torch.bfloat16, device="cuda")
    with programmatic_launch(True):
        if not replay:
            want = _unfused(want_pool, meta, args)
            got = fused_decode.qk_norm_rope_decode_attention(*args, got_pool, 1, meta)
        else:
            fused_decode.qk_norm_rope_decode_attention(*args, got_pool, 1, meta)  # counters allocated, kernels built
            _unfused(want_pool, meta, args)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                want = _unfused(want_pool, meta, args)
                got = fused_decode.qk_norm_rope_decode_attention(*args, got_pool, 1, meta)
            for _ in range(2):
                graph.replay()
        torch.cuda.synchronize()
    _assert_same(got, want, got_pool, want_pool)

