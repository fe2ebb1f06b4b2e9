"""Batch-1 linear layers as a Triton GEMV (prism.ops.gemv): the kernel against `F.linear` (Triton interpreter on the
CPU), the dispatch rule (one row only), and the decoder's layers switched on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prism.model.text import DecodeLinear, set_batch1_gemv
from prism.ops import gemv
from prism.ops import kv_write as kw
from prism.ops.dispatch import KERNELS_ENV

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
TRITON_OK = kw.HAVE_TRITON and (kw._INTERPRETED or torch.cuda.is_available())
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1 at import")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("n,k", [(8, 512), (37, 1000), (3, 70), (64, 2048)])  # tails in both dimensions
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_matches_linear(n, k, dtype):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(DEV)
    x = torch.randn(k, generator=g).to(dtype).to(DEV)
    want = F.linear(x[None].float(), w.float())[0]
    got = gemv.gemv(w, x)
    assert got.dtype == dtype and got.shape == (n,)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@needs_triton
def test_linear_takes_the_gemv_for_one_row_only(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "triton")
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda w, x: calls.append(1) or real(w, x))
    w, b = torch.randn(24, 40).to(DEV), torch.randn(24).to(DEV)
    one, three = torch.randn(1, 40).to(DEV), torch.randn(3, 40).to(DEV)
    torch.testing.assert_close(gemv.linear(one, w, b), F.linear(one, w, b), atol=1e-5, rtol=1e-5)
    assert calls == [1]
    torch.testing.assert_close(gemv.linear(three, w, b), F.linear(three, w, b))
    assert calls == [1], "a step of several rows must stay on F.linear"
    monkeypatch.setenv(KERNELS_ENV, "reference")
    gemv.linear(one, w, b)
    assert calls == [1], "PRISM_KERNELS=reference must keep F.linear"


def test_gemv_rejects_bad_shapes():
    with pytest.raises(ValueError, match="weight"):
        gemv.gemv(torch.zeros(4, 8), torch.zeros(7))
    with pytest.raises(ValueError, match="contiguous"):
        gemv.gemv(torch.zeros(8, 4).t(), torch.zeros(8))


@needs_triton
def test_decode_linear_is_switched_by_set_batch1_gemv(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "triton")
    model = torch.nn.Sequential(DecodeLinear(32, 16, bias=True), torch.nn.Linear(16, 16), DecodeLinear(16, 8)).to(DEV)
    x = torch.randn(1, 32).to(DEV)
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda w, v: calls.append(1) or real(w, v))
    with torch.no_grad():
        off = model(x)
        assert calls == [] and set_batch1_gemv(model, True) == 2
        on = model(x)
    assert len(calls) == 2
    torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 12288)])  # the 8B's QKV, O and down
def test_gemv_matches_linear_8b_shapes_bf16(n, k):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(k, device="cuda", generator=g, dtype=torch.bfloat16)
    want = F.linear(x[None].float(), w.float())[0]
    # both round the fp32 sum to bf16 once: within one bf16 ulp of the exact product
    torch.testing.assert_close(gemv.gemv(w, x).float(), want, atol=1e-3, rtol=2**-7)
    torch.testing.assert_close(F.linear(x[None], w)[0].float(), want, atol=1e-3, rtol=2**-7)
