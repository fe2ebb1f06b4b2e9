"""Spec of the decoder's residual add + RMSNorm folded into its batch-1 GEMVs (`prism.ops.gemv.ResidualRow`).

Invariant: a one-row decoder layer computes what the unfused layer computes. The O (or down) GEMV adds its product
to the residual stream and leaves per-program sums of squares; the next GEMV norms its input from them. Against the
unfused ops on the same operands (the product, `add_rms_norm_reference`, then the same GEMV): the sum equal, and the
normed products equal within the tolerance of the fp32 sum of squares running in another order; and bit for bit
where that order cannot matter (small-integer rows), against the unfused norm kernel. Any layer size, including
sizes that are not a multiple of the programs' rows or columns, and one partial or many.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.ops import gemv
from prism.ops import kv_write as kw
from prism.ops.fused_norms import add_rms_norm, add_rms_norm_reference

pytestmark = [
    pytest.mark.skipif(not (kw.HAVE_TRITON and (kw._INTERPRETED or torch.cuda.is_available())),
                       reason="the Triton GEMVs need CUDA or TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


@settings(max_examples=40, deadline=None)
@given(hidden=st.integers(1, 300), inner=st.integers(1, 300), out=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.float16]), scale=st.sampled_from([0.05, 1.0, 30.0]),
       eps=st.sampled_from([1e-6, 1e-2]), seed=st.integers(0, 2**16))
def spec_folded_residual_and_norm_equal_the_unfused_ops(hidden, inner, out, dtype, scale, eps, seed) -> None:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype).to(DEV)

    w_o, x, residual = rand(hidden, inner, s=0.1), rand(inner, s=scale), rand(hidden, s=scale)
    norm_w = (1 + torch.randn(hidden, generator=g) * 0.3).to(dtype).to(DEV)
    w_next, w_gate_up = rand(out, hidden, s=0.1), rand(2 * out, hidden, s=0.1)

    row = gemv.gemv_add_residual(w_o, x, residual)
    normed, summed = add_rms_norm_reference(gemv.gemv(w_o, x), residual, norm_w, eps)
    assert torch.equal(row.h, summed), "the folded add must round as HF's `residual + x`"
    want_sumsq = summed.float().square().sum()
    torch.testing.assert_close(row.sumsq.sum(), want_sumsq, rtol=1e-5, atol=1e-6)

    tol = TOL[dtype] * max(1.0, float(normed.float().abs().max()))
    got, want = gemv.gemv_rms_normed(w_next, row, norm_w, eps), gemv.gemv(w_next, normed)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=TOL[dtype])
    got = gemv.gemv_silu_and_mul_rms_normed(w_gate_up, row, norm_w, eps)
    want = gemv.gemv_silu_and_mul(w_gate_up, normed)
    torch.testing.assert_close(got.float(), want.float(), atol=tol * max(1.0, float(want.float().abs().max())),
                               rtol=TOL[dtype])


@settings(max_examples=30, deadline=None)
@given(hidden=st.integers(1, 300), out=st.integers(1, 24), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       eps=st.sampled_from([1e-6, 1e-2]), seed=st.integers(0, 2**16))
def spec_folded_norm_rounds_as_the_unfused_norm(hidden, out, dtype, eps, seed) -> None:
    """Bit for bit where the order of the sum of squares cannot matter: a residual of small integers (every square
    and every partial sum exact in fp32) and a zero product (so the folded add returns it unchanged). Any rounding
    step the fold dropped or added (the normed value, or its product with the norm's weight) shows as other bits."""
    g = torch.Generator().manual_seed(seed)
    residual = torch.randint(-8, 9, (hidden,), generator=g).to(dtype).to(DEV)
    inner = 8
    row = gemv.gemv_add_residual(torch.zeros(hidden, inner, dtype=dtype, device=DEV),
                                 torch.zeros(inner, dtype=dtype, device=DEV), residual)
    assert torch.equal(row.h, residual)
    norm_w = (1 + torch.randn(hidden, generator=g) * 0.3).to(dtype).to(DEV)
    # against the unfused norm kernel, which the unfolded step runs (in the interpreter both round bf16 as it does,
    # by truncation, where torch rounds to nearest: the torch reference is not bitwise comparable there)
    normed = add_rms_norm(torch.zeros_like(residual)[None], residual[None], norm_w, eps, use_triton=True)[0][0]
    w_next = (torch.randn(out, hidden, generator=g) * 0.05).to(dtype).to(DEV)
    w_gate_up = (torch.randn(2 * out, hidden, generator=g) * 0.05).to(dtype).to(DEV)
    assert torch.equal(gemv.gemv_rms_normed(w_next, row, norm_w, eps), gemv.gemv(w_next, normed)), \
        "the folded norm rounds otherwise than the unfused one"
    assert torch.equal(gemv.gemv_silu_and_mul_rms_normed(w_gate_up, row, norm_w, eps),
                       gemv.gemv_silu_and_mul(w_gate_up, normed)), "the folded norm rounds otherwise (gate/up)"
