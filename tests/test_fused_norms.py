"""The fused element-wise kernels (`ops.fused_norms`) against their torch references (HF's op order).

Run under the Triton interpreter on the CPU (fp32 and fp16; the interpreter is not trusted for bf16),
with the strided views the decoder hands them (q/k are column blocks of the fused qkv output). The
planted-bug check shows the comparison catches a rope that rotates the wrong way.
"""

from __future__ import annotations

import pytest
import torch

from prism.ops import fused_norms as fn
from prism.ops.kv_write import HAVE_TRITON

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-6, torch.float16: 2e-3}


def _qkv(n: int, hq: int, hkv: int, d: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n, (hq + 2 * hkv) * d, generator=g) * 3).to(DEV, dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    qw, kw = (torch.rand(d, generator=g) + 0.5).to(DEV, dtype), (torch.rand(d, generator=g) + 0.5).to(DEV, dtype)
    pos = torch.randint(0, 5000, (n,), generator=g).float()[:, None]
    freqs = pos * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat((freqs, freqs), dim=-1)
    return q.view(n, hq, d), k.view(n, hkv, d), qw, kw, emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (5, 96), (3, 4, 32)])
def test_rms_norm_kernel_matches_reference(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 2).to(DEV, dtype)
    w = torch.rand(shape[-1], generator=g).to(DEV, dtype)
    got = fn.rms_norm(x, w, 1e-6, use_triton=True)
    want = fn.rms_norm_reference(x, w, 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype] * 8, rtol=TOL[dtype])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(4, 2), (2, 1), (6, 3)])  # (6, 3): masked head rows
def test_qk_norm_rope_kernel_matches_reference(dtype, heads):
    q, k, qw, kw, cos, sin = _qkv(6, *heads, 32, dtype, seed=heads[0])
    got_q, got_k = fn.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin, use_triton=True)
    want_q, want_k = fn.qk_norm_rope_reference(q, k, qw, kw, 1e-6, cos, sin)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype] * 8, rtol=TOL[dtype])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_kernel_matches_reference(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 2 * 48, generator=g) * 4).to(DEV, dtype)
    got = fn.silu_and_mul(x, use_triton=True)
    torch.testing.assert_close(got.float(), fn.silu_and_mul_reference(x).float(), atol=TOL[dtype] * 8,
                               rtol=TOL[dtype])


@needs_triton
def test_a_wrong_rotation_fails_the_comparison(monkeypatch):
    """Planted bug: the reference rotating the other way must not match the kernel."""
    q, k, qw, kw, cos, sin = _qkv(4, 2, 1, 32, torch.float32, seed=9)
    got_q, _ = fn.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin, use_triton=True)
    monkeypatch.setattr(fn, "rotate_half", lambda x: torch.cat((x.chunk(2, -1)[1], -x.chunk(2, -1)[0]), -1))
    wrong_q, _ = fn.qk_norm_rope_reference(q, k, qw, kw, 1e-6, cos, sin)
    assert (got_q - wrong_q).abs().max() > 1e-2


def test_cpu_default_is_the_reference_exactly():
    q, k, qw, kw, cos, sin = _qkv(3, 2, 1, 16, torch.float32, seed=1)
    if DEV != "cpu":
        pytest.skip("the default dispatch picks the kernel on CUDA")
    got = fn.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    want = fn.qk_norm_rope_reference(q, k, qw, kw, 1e-6, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_kernel_matches_reference(dtype):
    g = torch.Generator().manual_seed(5)
    x, r = ((torch.randn(6, 96, generator=g) * 3).to(DEV, dtype) for _ in range(2))
    w = (torch.rand(96, generator=g) + 0.5).to(DEV, dtype)
    got_norm, got_sum = fn.add_rms_norm(x, r, w, 1e-6, use_triton=True)
    want_norm, want_sum = fn.add_rms_norm_reference(x, r, w, 1e-6)
    assert torch.equal(got_sum, want_sum), "the residual sum is one rounding of x + r, exactly"
    torch.testing.assert_close(got_norm.float(), want_norm.float(), atol=TOL[dtype] * 8, rtol=TOL[dtype])
    with pytest.raises(ValueError, match="differ"):
        fn.add_rms_norm(x, r[:3], w, 1e-6)
