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
from prism.ops.fused_norms import silu_and_mul_reference

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
TRITON_OK = kw.HAVE_TRITON and (kw._INTERPRETED or torch.cuda.is_available())
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1 at import")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def count_calls(monkeypatch, name: str) -> list:
    """`gemv.<name>` wrapped to note each call (the kernels still run): the list of calls."""
    calls = []
    real = getattr(gemv, name)
    monkeypatch.setattr(gemv, name, lambda w, x: calls.append(1) or real(w, x))
    return calls


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
    calls = count_calls(monkeypatch, "gemv")
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
    calls = count_calls(monkeypatch, "gemv")
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


# ------------------------------------------------------------------ gate/up GEMV with the activation fused
def silu_and_mul_of_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The unfused reference in fp32: silu(gate . x) * (up . x)."""
    return silu_and_mul_reference(F.linear(x[None].float(), w.float()))[0]


@needs_triton
@pytest.mark.parametrize("inter,k", [(4, 512), (37, 1000), (3, 70), (64, 2048)])  # tails in both dimensions
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_silu_and_mul_matches_the_unfused_ops(inter, k, dtype):
    g = torch.Generator().manual_seed(inter + k)
    w = (torch.randn(2 * inter, k, generator=g) * 0.05).to(dtype).to(DEV)
    x = torch.randn(k, generator=g).to(dtype).to(DEV)
    got = gemv.gemv_silu_and_mul(w, x)
    assert got.dtype == dtype and got.shape == (inter,)
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.float(), silu_and_mul_of_linear(x, w), atol=tol, rtol=tol)


@needs_triton
def test_gemv_silu_and_mul_pairs_each_gate_row_with_its_up_row():
    """A planted swap (row i's gate against up row i + 1) must show: each output reads its own pair."""
    inter, k = 8, 64
    w = torch.zeros(2 * inter, k, dtype=torch.float32, device=DEV)
    for i in range(inter):
        w[i, 0] = 1.0 + i  # gate_i . x = 1 + i with x = e0
        w[inter + i, 0] = 10.0 * (i + 1)  # up_i . x = 10 (i + 1)
    x = torch.zeros(k, device=DEV)
    x[0] = 1.0
    got = gemv.gemv_silu_and_mul(w, x).cpu()
    gate, up = torch.arange(1.0, inter + 1), 10.0 * torch.arange(1.0, inter + 1)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-4, rtol=1e-5)


def test_gemv_silu_and_mul_rejects_an_odd_row_count():
    with pytest.raises(ValueError, match="even"):
        gemv.gemv_silu_and_mul(torch.zeros(7, 8), torch.zeros(8))


@needs_triton
def test_silu_and_mul_linear_takes_the_fused_gemv_for_one_row_only(monkeypatch):
    from prism.ops.fused_norms import silu_and_mul

    monkeypatch.setenv(KERNELS_ENV, "triton")
    calls = count_calls(monkeypatch, "gemv_silu_and_mul")
    w = (torch.randn(48, 40) * 0.1).to(DEV)
    one, three = torch.randn(1, 40).to(DEV), torch.randn(3, 40).to(DEV)
    torch.testing.assert_close(gemv.silu_and_mul_linear(one, w), silu_and_mul(F.linear(one, w)), atol=1e-5,
                               rtol=1e-5)
    assert calls == [1]
    torch.testing.assert_close(gemv.silu_and_mul_linear(three, w), silu_and_mul(F.linear(three, w)))
    assert calls == [1], "a step of several rows must stay on F.linear"


@needs_triton
def test_the_mlp_is_switched_by_set_batch1_gemv(monkeypatch):
    from prism.model.config import TextConfig
    from prism.model.text import TextMLP

    monkeypatch.setenv(KERNELS_ENV, "triton")
    cfg = TextConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, vocab_size=64, rope_theta=1e4, mrope_section=(4, 2, 2))
    mlp = TextMLP(cfg).to(DEV)
    calls = count_calls(monkeypatch, "gemv_silu_and_mul")
    x = torch.randn(1, 32).to(DEV)
    with torch.no_grad():
        off = mlp(x)
        assert calls == [] and set_batch1_gemv(mlp, True) == 2  # the MLP and its down projection
        on = mlp(x)
    assert calls == [1]
    torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gemv_silu_and_mul_matches_the_unfused_ops_8b_shape_bf16():
    from prism.ops.fused_norms import silu_and_mul

    g = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(2 * 12288, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(4096, device="cuda", generator=g, dtype=torch.bfloat16)
    want = silu_and_mul_of_linear(x, w)
    # each rounds the two sums, the silu and the product to bf16: a few bf16 ulps of the exact value
    torch.testing.assert_close(gemv.gemv_silu_and_mul(w, x).float(), want, atol=2e-3, rtol=2**-6)
    torch.testing.assert_close(silu_and_mul(F.linear(x[None], w))[0].float(), want, atol=2e-3, rtol=2**-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_programmatic_launch_changes_no_bit_of_a_captured_chain():
    """Twenty dependent GEMVs (each reads the previous one's output) in a CUDA graph, launched early or not:
    the same bits. A kernel that read its input before `griddepcontrol.wait` would read a stale vector."""
    from prism.ops.pdl import programmatic_launch

    g = torch.Generator(device="cuda").manual_seed(3)
    # std 1/sqrt(K): each product keeps the vector's scale, so twenty stay finite without a kernel in between
    ws = [torch.randn(2048, 2048, device="cuda", generator=g, dtype=torch.bfloat16) / 2048**0.5 for _ in range(4)]
    x0 = torch.randn(2048, device="cuda", generator=g, dtype=torch.bfloat16)
    out = {}
    for early in (False, True):
        x = x0.clone()
        with programmatic_launch(early):
            gemv.gemv(ws[0], x)  # compiles this variant outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = x
                for i in range(20):
                    y = gemv.gemv(ws[i % 4], y)
        graph.replay()
        torch.cuda.synchronize()
        out[early] = y.clone()
    assert torch.isfinite(out[False]).all() and out[False].abs().max() > 0.01
    assert torch.equal(out[True], out[False])
