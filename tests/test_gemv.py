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


# ------------------------------------------------------------------ residual add + RMSNorm folded in (ResidualRow)
def residual_row_reference(w: torch.Tensor, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """HF's `residual + o_proj(x)`: the product rounded to the activation dtype, then the sum rounded."""
    return residual + F.linear(x[None].float(), w.float())[0].to(x.dtype)


@needs_triton
@pytest.mark.parametrize("n,k", [(8, 512), (37, 1000), (3, 70), (64, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])  # (no tl.dot: bf16 is exact)
def test_gemv_add_residual_adds_and_leaves_the_sums_of_squares(n, k, dtype):
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(DEV)
    x, r = torch.randn(k, generator=g).to(dtype).to(DEV), torch.randn(n, generator=g).to(dtype).to(DEV)
    row = gemv.gemv_add_residual(w, x, r)
    assert row.h.dtype == dtype and row.h.shape == (n,)
    assert row.sumsq.shape == (-(-n // gemv.BLOCK_N),) and row.sumsq.dtype == torch.float32
    # within one rounding of the product (the GEMV's fp32 sum runs in another order than F.linear's)
    ulp = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(row.h.float(), residual_row_reference(w, x, r).float(), atol=4 * ulp, rtol=2 * ulp)
    # the partials are of h exactly as stored (what the norm will see), each over its program's rows
    want = row.h.float().square()
    want = F.pad(want, (0, row.sumsq.numel() * gemv.BLOCK_N - n)).view(-1, gemv.BLOCK_N).sum(1)
    torch.testing.assert_close(row.sumsq, want, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("h_len,out", [(40, 24), (1000, 37), (2048, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_normed_gemvs_equal_the_norm_then_the_gemv(h_len, out, dtype):
    """`gemv_rms_normed` / `gemv_silu_and_mul_rms_normed` against `rms_norm_reference` of the row, then the same
    GEMV: the norm's roundings are the reference's (only the fp32 sum of squares runs in another order)."""
    from prism.ops.fused_norms import rms_norm_reference

    g = torch.Generator().manual_seed(h_len + out)
    # the row as a producer leaves it: h and its partial sums of squares (here 5 uneven blocks)
    h = (torch.randn(h_len, generator=g) * 3).to(dtype).to(DEV)
    bounds = torch.linspace(0, h_len, 6).long().tolist()
    sumsq = torch.stack([h[a:b].float().square().sum() for a, b in zip(bounds, bounds[1:], strict=False)])
    row = gemv.ResidualRow(h, sumsq)
    norm_w = (1 + 0.2 * torch.randn(h_len, generator=g)).to(dtype).to(DEV)
    w = (torch.randn(out, h_len, generator=g) * 0.05).to(dtype).to(DEV)
    normed = rms_norm_reference(h, norm_w, 1e-6)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(gemv.gemv_rms_normed(w, row, norm_w, 1e-6).float(), gemv.gemv(w, normed).float(),
                               atol=tol, rtol=tol)
    w2 = (torch.randn(2 * out, h_len, generator=g) * 0.05).to(dtype).to(DEV)
    torch.testing.assert_close(gemv.gemv_silu_and_mul_rms_normed(w2, row, norm_w, 1e-6).float(),
                               gemv.gemv_silu_and_mul(w2, normed).float(), atol=tol, rtol=tol)


def test_residual_rows_and_the_normed_gemvs_reject_what_does_not_fit():
    with pytest.raises(ValueError, match="one contiguous row"):
        gemv.ResidualRow(torch.zeros(2, 4), torch.zeros(1))
    with pytest.raises(ValueError, match="fp32"):
        gemv.ResidualRow(torch.zeros(4), torch.zeros(1, dtype=torch.float16))
    row = gemv.ResidualRow(torch.zeros(8), torch.zeros(1))
    with pytest.raises(ValueError, match="norm's weight"):
        gemv.gemv_rms_normed(torch.zeros(4, 8), row, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        gemv.gemv_silu_and_mul_rms_normed(torch.zeros(4, 9), row, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        gemv.gemv_add_residual(torch.zeros(4, 8), torch.zeros(8), torch.zeros(5))


def tiny_decoder(layers: int = 2):
    from prism.model.config import TextConfig
    from prism.model.text import TextDecoder

    cfg = TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=64, rope_theta=1e4, mrope_section=(4, 2, 2))
    torch.manual_seed(5)
    decoder = TextDecoder(cfg).to(DEV)
    with torch.no_grad():
        for name, p in decoder.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))  # norm weights other than ones, so a skipped norm shows
            else:
                p.mul_(4.0)  # large enough that each residual add and norm matters to the output
    return decoder


def one_row_forward(decoder, x: torch.Tensor) -> torch.Tensor:
    from prism.model.attention import DenseCausalAttention

    with torch.no_grad():
        return decoder(x, torch.zeros(3, 1, dtype=torch.long, device=DEV), DenseCausalAttention([1]))


def unfused_one_row(monkeypatch) -> tuple:
    """(a tiny decoder with its folded path switched on, a row, that row through the same GEMVs unfolded)."""
    from prism.model.text import set_batch1_gemv

    monkeypatch.setenv(KERNELS_ENV, "triton")
    decoder = tiny_decoder()
    x = torch.randn(1, 64).to(DEV)
    set_batch1_gemv(decoder, True, fused_norms=False)
    unfused = one_row_forward(decoder, x)
    set_batch1_gemv(decoder, True)
    return decoder, x, unfused


@needs_triton
def test_a_one_row_decoder_step_with_the_norms_folded_equals_the_unfused_step(monkeypatch):
    """The decoder at one row, its residual adds and norms folded into the GEMVs (`forward_one_row`), against
    the same GEMVs with the norm kernels between them and against F.linear: the same output, and no norm kernel
    but layer 0's input norm and the final one."""
    import prism.model.text as text_mod
    from prism.model.text import set_batch1_gemv

    decoder, x, unfused = unfused_one_row(monkeypatch)
    set_batch1_gemv(decoder, False)
    reference = one_row_forward(decoder, x)
    set_batch1_gemv(decoder, True)
    norms = []
    for name in ("add_rms_norm", "rms_norm"):
        real = getattr(text_mod, name)
        monkeypatch.setattr(text_mod, name, lambda *a, _real=real, _name=name: norms.append(_name) or _real(*a))
    fused = one_row_forward(decoder, x)
    assert norms == ["rms_norm", "rms_norm"], f"only layer 0's input norm and the final norm run alone: {norms}"
    assert fused.abs().max() > 0.1
    torch.testing.assert_close(fused, unfused, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused, reference, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("planted", ["residual not added", "norm weight skipped"])
def test_the_one_row_comparison_fails_on_a_planted_folding_bug(monkeypatch, planted):
    """The comparison above with a bug planted in the folded path: it must see it."""
    decoder, x, unfused = unfused_one_row(monkeypatch)
    if planted == "residual not added":
        real = gemv.gemv_add_residual
        monkeypatch.setattr(gemv, "gemv_add_residual", lambda w, x, r: real(w, x, torch.zeros_like(r)))
    else:
        real = gemv.gemv_rms_normed
        monkeypatch.setattr(gemv, "gemv_rms_normed", lambda w, row, nw, eps: real(w, row, torch.ones_like(nw), eps))
    fused = one_row_forward(decoder, x)
    assert not torch.allclose(fused, unfused, atol=1e-4, rtol=1e-4), f"the planted bug ({planted}) went unseen"


@needs_triton
def test_the_folded_path_is_not_taken_where_it_cannot_serve(monkeypatch):
    """Several rows, the GEMVs off, or a row-parallel O projection (tensor parallelism): the unfused layer."""
    from prism.model.text import set_batch1_gemv

    monkeypatch.setenv(KERNELS_ENV, "triton")
    decoder = tiny_decoder(layers=1)
    layer = decoder.layers[0]
    one, three = torch.randn(1, 64).to(DEV), torch.randn(3, 64).to(DEV)
    assert not layer.folds_norms_into_gemvs(one)
    set_batch1_gemv(decoder, True)
    assert layer.folds_norms_into_gemvs(one) and not layer.folds_norms_into_gemvs(three)
    set_batch1_gemv(decoder, True, fused_norms=False)
    assert not layer.folds_norms_into_gemvs(one)
    # the layer's modules are judged when `set_batch1_gemv` configures it (after loading and sharding)
    layer.mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(64, device=DEV))  # a bias the GEMV would not add
    set_batch1_gemv(decoder, True)
    assert not layer.folds_norms_into_gemvs(one)
    layer.mlp.down_proj.bias = None
    set_batch1_gemv(decoder, True)
    assert layer.folds_norms_into_gemvs(one) and not layer.folds_norms_into_gemvs(one.half())  # another dtype
    layer.mlp.gate_up.weight.data = layer.mlp.gate_up.weight.data.half()  # weights of two dtypes
    set_batch1_gemv(decoder, True)
    assert not layer.folds_norms_into_gemvs(one)
    layer.mlp.gate_up.weight.data = layer.mlp.gate_up.weight.data.float()
    layer.self_attn.o_proj = torch.nn.Linear(64, 64, bias=False).to(DEV)  # stands in for a row-parallel layer
    set_batch1_gemv(decoder, True)
    assert not layer.folds_norms_into_gemvs(one)


@needs_triton
def test_a_one_row_step_with_deepstack_features_stays_unfolded(monkeypatch):
    """A one-row step whose row is a visual token (DeepStack features added after the first layers) runs the
    unfolded layers: the same output as with the folding off, and no folded GEMV called."""
    from prism.model.attention import DenseCausalAttention
    from prism.model.text import DeepstackInput, set_batch1_gemv

    decoder, x, _ = unfused_one_row(monkeypatch)
    deepstack = DeepstackInput(token_index=None, features=torch.randn(1, 1, 64).to(DEV))
    positions = torch.zeros(3, 1, dtype=torch.long, device=DEV)

    def forward():
        with torch.no_grad():
            return decoder(x, positions, DenseCausalAttention([1]), deepstack)

    set_batch1_gemv(decoder, True, fused_norms=False)
    want = forward()
    set_batch1_gemv(decoder, True)
    calls = []
    real = gemv.gemv_add_residual
    monkeypatch.setattr(gemv, "gemv_add_residual", lambda *a: calls.append(1) or real(*a))
    torch.testing.assert_close(forward(), want, atol=0, rtol=0)
    assert calls == [], "the folded path cannot add DeepStack's features: it must not be taken"


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_folded_residual_and_norm_gemvs_match_the_unfused_ops_8b_shapes_bf16():
    """O with the residual add, then gate/up with the norm and the activation, at the 8B's shapes in bf16, against
    the GEMVs with `add_rms_norm` between them (what the unfused one-row step runs)."""
    from prism.ops.fused_norms import add_rms_norm

    g = torch.Generator(device="cuda").manual_seed(11)
    w_o = torch.randn(4096, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    w_gu = torch.randn(2 * 12288, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    norm_w = 1 + 0.1 * torch.randn(4096, device="cuda", generator=g, dtype=torch.bfloat16)
    x = torch.randn(4096, device="cuda", generator=g, dtype=torch.bfloat16)
    residual = torch.randn(4096, device="cuda", generator=g, dtype=torch.bfloat16) * 4
    row = gemv.gemv_add_residual(w_o, x, residual)
    normed, summed = add_rms_norm(gemv.gemv(w_o, x)[None], residual[None], norm_w, 1e-6)
    assert torch.equal(row.h, summed[0]), "the same product and the same rounded add"
    torch.testing.assert_close(row.sumsq.sum(), summed.float().square().sum(), rtol=1e-5, atol=0)
    want = gemv.gemv_silu_and_mul(w_gu, normed[0])
    got = gemv.gemv_silu_and_mul_rms_normed(w_gu, row, norm_w, 1e-6)
    # the norm's sum of squares in another order: at most a rounding of a few normed inputs apart
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2**-6)
    # bitwise where that order cannot matter: a residual of small integers (exact squares and sums), a zero product
    small = torch.randint(-8, 9, (4096,), device="cuda", generator=g).to(torch.bfloat16)
    row = gemv.gemv_add_residual(torch.zeros_like(w_o), x, small)
    normed = add_rms_norm(torch.zeros_like(small)[None], small[None], norm_w, 1e-6)[0][0]
    assert torch.equal(row.h, small)
    assert torch.equal(gemv.gemv_rms_normed(w_o, row, norm_w, 1e-6), gemv.gemv(w_o, normed))
    assert torch.equal(gemv.gemv_silu_and_mul_rms_normed(w_gu, row, norm_w, 1e-6), gemv.gemv_silu_and_mul(w_gu, normed))
