"""`qk_norm_rope_write_kv` (ops/qk_norm_rope_kv.py): one launch leaves the bytes and returns the q of
`qk_norm_rope` then `write_kv`, for every pool kind, through the Triton interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from prism.kv.fp8 import KVLayout, KVPool
from prism.ops import kv_write
from prism.ops.attention_metadata import PagedAttentionMetadata
from prism.ops.fused_norms import qk_norm_rope
from prism.ops.kv_write import write_kv
from prism.ops.paged_attention import PagedKVBackend
from prism.ops.qk_norm_rope_kv import qk_norm_rope_write_kv

needs_triton = pytest.mark.skipif(not kv_write._INTERPRETED and not torch.cuda.is_available(),
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1 at import")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")  # the interpreter's
HQ, HKV, D = 4, 2, 16


def _inputs(n: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu", heads: tuple[int, int, int] = (HQ, HKV, D)):
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n, (hq + 2 * hkv) * d, generator=g) * 3).to(device, dtype)  # views of one output, as the model
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
    qw, kw = ((torch.rand(d, generator=g) + 0.5).to(device, dtype) for _ in range(2))
    angles = torch.rand(n, d // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(device, dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(device, dtype)
    return q, k, v, qw, kw, cos, sin


def _gpu(*values):
    return pytest.param(*values, marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                              reason="needs a CUDA device")])


@needs_triton
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize(("dtype", "device"), [(torch.float32, "cpu"), (torch.float16, "cpu"),
                                               _gpu(torch.bfloat16, "cuda")])
def test_fused_equals_norm_rope_then_write(kv_dtype, dtype, device):
    """On the CPU through the interpreter; on the GPU compiled, in bf16, with the 8B model's heads (where fused
    multiply-adds could break the equality)."""
    heads, n = ((HQ, HKV, D), 5) if device == "cpu" else ((32, 8, 128), 300)
    layout = KVLayout(num_layers=2, num_kv_heads=heads[1], head_dim=heads[2], page_size=4, num_pages=128,
                      kv_dtype=kv_dtype)
    q, k, v, qw, kw, cos, sin = _inputs(n, dtype, device=device, heads=heads)
    slots = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(n))[:n].to(device)
    want_pool, got_pool = KVPool.allocate(layout, device), KVPool.allocate(layout, device)
    want_q, want_k = qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin, use_triton=True)
    write_kv(want_pool, 1, slots, want_k, v, use_triton=True)
    got_q = qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, cos, sin, got_pool, 1, slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_pool.payload_bits(), want_pool.payload_bits())
    assert got_pool.scales is None or torch.equal(got_pool.scales, want_pool.scales)


@needs_triton
def test_fused_checks_host_slots_and_layer_before_writing():
    layout = KVLayout(num_layers=1, num_kv_heads=HKV, head_dim=D, page_size=4, num_pages=2, kv_dtype="fp8")
    q, k, v, qw, kw, cos, sin = _inputs(2, torch.float32)
    pool = KVPool.allocate(layout, "cpu")
    before = pool.payload_bits().clone()
    with pytest.raises(ValueError, match="out of range"):
        qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, cos, sin, pool, 0, torch.tensor([-1, 8]))
    with pytest.raises(IndexError):
        qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, cos, sin, pool, 1, torch.tensor([0, 1]))
    assert torch.equal(pool.payload_bits(), before)


@needs_triton
def test_backend_attend_unrotated_equals_attend_of_rotated():
    """The decoder's fused entry point gives the attention output and pool of norm + rope, then `attend`."""
    layout = KVLayout(num_layers=1, num_kv_heads=HKV, head_dim=D, page_size=4, num_pages=4, kv_dtype="fp8")
    q, k, v, qw, kw, cos, sin = _inputs(3, torch.float32, seed=1)
    meta = PagedAttentionMetadata.build([3], [3], [[2]], 4, "cpu")
    want_pool, got_pool = KVPool.allocate(layout, "cpu"), KVPool.allocate(layout, "cpu")
    rq, rk = qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin, use_triton=True)
    want = PagedKVBackend(want_pool, meta, use_triton=True).attend(0, rq, rk, v)
    got = PagedKVBackend(got_pool, meta, use_triton=True).attend_unrotated(0, q, k, v, qw, kw, 1e-6, cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(got_pool.payload_bits(), want_pool.payload_bits())



if kv_write.HAVE_TRITON:
    import triton
    import triton.language as tl

    from prism.ops import fused_norms

    @triton.jit
    def _unrounded_norm_rope_values(src, stride_h, w_ptr, cos_ptr, sin_ptr, num_heads, eps, HALF: tl.constexpr,
                                    BLOCK_H: tl.constexpr, DTYPE: tl.constexpr):
        """The planted bug below: k off by a fraction of the activation dtype's ulp, as when the rope's fp32 sum
        is quantized without its rounding to that dtype."""
        o1, o2, h, j = fused_norms.norm_rope_values(src, stride_h, w_ptr, cos_ptr, sin_ptr, num_heads, eps, HALF,
                                                    BLOCK_H, DTYPE)
        x1 = tl.load(src + h[:, None].to(tl.int64) * stride_h + j[None, :], mask=(h < num_heads)[:, None], other=0.0)
        return o1 + x1.to(tl.float32) * 1e-4, o2, h, j


@pytest.mark.skipif(not kv_write._INTERPRETED, reason="re-binding a jit function's callee needs the interpreter")
def test_quantizing_the_unrounded_rotated_k_is_caught(monkeypatch: pytest.MonkeyPatch):
    from prism.ops import qk_norm_rope_kv as fused

    monkeypatch.setattr(fused, "norm_rope_values", _unrounded_norm_rope_values)
    with pytest.raises(AssertionError):
        test_fused_equals_norm_rope_then_write("fp32", torch.float16, "cpu")
