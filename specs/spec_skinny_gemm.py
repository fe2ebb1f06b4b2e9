"""Spec of the few-rows GEMM (`prism.ops.skinny_gemm`), which decode steps of 2 .. 16 rows run on the GPU (and of
17 .. 32 rows: its narrow band for O and down, its wide band, a swap-AB launch, for QKV and gate/up).

Invariant: each row of the step gets its own product, `F.linear`'s (gate/up: `silu_and_mul` of it), whatever rows
are beside it, and however many programs share its K (fp32 partials added in split order; `SPLIT_K`, and
`NARROW_SPLIT_K` for narrow launches of 17 .. 32 rows, each drawn on its own). Against `F.linear` within the
tolerance of fp32 sums in another order; bit for bit where the order cannot matter (small-integer operands, whose
sums are exact in fp32); and for the gate/up variant, whose activation rounds and which keeps one split at any row
count, bit for bit against the same kernel with the row among other companions. (Rows beside it may change the
split: a step of 17 rows splits O and down where one of 16 does not, so there their bits follow the batch, as
cuBLAS's did.) Any step of 2 .. 32 rows, any layer size including ones that are not a multiple of the tiles, wide
launches beside narrow ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.ops import kv_write as kw
from prism.ops import skinny_gemm
from prism.ops.fused_norms import silu_and_mul_reference
from prism.testing.knobs import module_knobs

pytestmark = [
    pytest.mark.skipif(not (kw.HAVE_TRITON and (kw._INTERPRETED or torch.cuda.is_available())),
                       reason="the Triton GEMM needs CUDA or TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),  # silu of a large negative
]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}
# Small tiles on the CPU (the interpreter's time grows with the tile), the engine's on the GPU; a narrow band's limit
# that the drawn layer sizes cross (at most 2 x 70 outputs), so that both split knobs rule some launches
KNOBS = ({"BLOCK_N": 16, "BLOCK_K": 32, "SILU_BLOCK_N": 16, "SILU_BLOCK_K": 32, "NARROW_MAX_TILES": 4,
          "WIDE_BLOCK_N": 16, "WIDE_BLOCK_K": 32, "WIDE_SILU_BLOCK_K": 32} if DEV == "cpu" else {"NARROW_MAX_TILES": 1})
# K long enough for several of the tiles (the engine's 256-column ones on the GPU), so that splits happen
MAX_K = 200 if DEV == "cpu" else 1200
SPLITS = st.sampled_from([1, 2, 3, 8])  # programs along K (fewer when K has fewer tiles)
ROWS = 32


def _with_knobs(fn, splits: tuple[int, int] = (1, 1)):
    """fn() with the test tiles, SPLIT_K and NARROW_SPLIT_K = `splits`, and the narrow and wide bands at 17 .. 32
    rows."""
    with module_knobs(skinny_gemm, {**KNOBS, "SPLIT_K": splits[0], "NARROW_SPLIT_K": splits[1], "MAX_ROWS": 16,
                                    "NARROW_MAX_ROWS": ROWS, "WIDE_MAX_ROWS": ROWS}):
        return fn()


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, ROWS), n=st.integers(1, 70), k=st.integers(1, MAX_K),
       dtype=st.sampled_from([torch.float32, torch.float16]), splits=st.tuples(SPLITS, SPLITS),
       seed=st.integers(0, 2**16))
def spec_skinny_gemm_equals_linear(rows, n, k, dtype, splits, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(2 * n, k, generator=g) * 0.1).to(dtype).to(DEV)
    want = F.linear(x.double(), w.double()).float()
    got = _with_knobs(lambda: skinny_gemm.skinny_gemm(x, w), splits)
    err = float((got.float() - want).abs().max())
    assert err <= TOL[dtype] * (1 + float(want.abs().max())), f"not close to F.linear: {err} ({rows} x {k} -> {2 * n})"
    got = _with_knobs(lambda: skinny_gemm.skinny_gemm_silu_and_mul(x, w), splits)
    want = silu_and_mul_reference(F.linear(x.float(), w.float()))
    err = float((got.float() - want).abs().max())
    assert err <= TOL[dtype] * (1 + float(want.abs().max())), f"gate/up not close to the reference: {err}"


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, ROWS), n=st.integers(1, 70), k=st.integers(1, MAX_K), splits=st.tuples(SPLITS, SPLITS),
       seed=st.integers(0, 2**16), data=st.data())
def spec_each_row_gets_its_own_product_whatever_is_beside_it(rows, n, k, splits, seed, data) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, k), generator=g).float().to(DEV)  # exact fp32 sums: any order, the same bits
    w = torch.randint(-3, 4, (2 * n, k), generator=g).float().to(DEV)
    got = _with_knobs(lambda: skinny_gemm.skinny_gemm(x, w), splits)
    assert torch.equal(got, F.linear(x, w)), "a row's product is not F.linear's (rows mixed up, or a tail lost)"
    # the same rows in another order beside other companions (at least two rows, so the kernel still takes them)
    order = data.draw(st.permutations(range(rows)))
    others = torch.randint(-3, 4, (data.draw(st.integers(0, ROWS - rows)), k), generator=g).float().to(DEV)
    step = torch.cat([x[list(order)], others])
    silu = _with_knobs(lambda: skinny_gemm.skinny_gemm_silu_and_mul(x, w), splits)
    again = _with_knobs(lambda: skinny_gemm.skinny_gemm_silu_and_mul(step, w), splits)
    assert torch.equal(again[: rows], silu[list(order)]), "a row's gate/up output changed with its companions"
