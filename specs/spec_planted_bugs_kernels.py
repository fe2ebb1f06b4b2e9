"""Proof that the kernels' specs bite: each plausible or historical bug of the few-rows GEMM (skinny GEMM), cascade
attention and the folded norms, planted.

Most plant a wrong launch of the real Triton kernel (`_plant_launch`) and require the spec that owns the kernel's
invariant to fail (see `specs/planted.py`).
"""

from __future__ import annotations

import pytest

from prism.ops import kv_write
from specs.planted import _spec_fails


def _plant_launch(monkeypatch: pytest.MonkeyPatch, module, name: str, change) -> None:
    """Plant a bug in how `module.<name>` (a Triton kernel, launched as `kernel[grid](*args, **kw)`) is launched:
    every launch gets `change(args, kw)`'s (args, kw) instead."""
    kernel = getattr(module, name)

    class PlantedLaunch:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                args, kw = change(args, kw)
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(module, name, PlantedLaunch())


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_gate_up_reading_its_gate_rows_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The few-rows GEMM's gate/up launch: output i is silu(x . gate_i) * (x . up_i). Planted (found by a review of
    the specs: no check covered the activation's values): the up rows read at the gate rows (INTER launched as 0)."""
    from prism.ops import skinny_gemm
    from specs import spec_skinny_gemm

    _plant_launch(monkeypatch, skinny_gemm, "_skinny_gemm_kernel",
                  lambda args, kw: ((*args[:11], 0, *args[12:]), kw) if kw.get("SILU") else (args, kw))  # INTER
    _spec_fails(spec_skinny_gemm.spec_skinny_gemm_equals_linear, "gate/up not close")


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
def test_skinny_gemm_rows_read_as_one_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The few-rows GEMM: each output row is the product of its own row of x. Planted: x's row stride launched as 0,
    so every row of the step reads the first one (a broadcast where a stride belongs)."""
    from prism.ops import skinny_gemm
    from specs import spec_skinny_gemm

    _plant_launch(monkeypatch, skinny_gemm, "_skinny_gemm_kernel",
                  lambda args, kw: ((*args[:8], 0, *args[9:]), kw))  # args[8]: stride_xm
    _spec_fails(spec_skinny_gemm.spec_each_row_gets_its_own_product_whatever_is_beside_it, "rows mixed up")


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
def test_a_swap_ab_launch_storing_rows_as_columns_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wide band's swap-AB launch computes y^T: its store must put output column c of step row m at y[m, c].
    Planted: its launches given an output row stride of 1 (the transposed tile written as if it were y's rows)."""
    from prism.ops import skinny_gemm
    from specs import spec_skinny_gemm

    _plant_launch(monkeypatch, skinny_gemm, "_skinny_gemm_kernel",
                  lambda args, kw: ((*args[:10], 1, *args[11:]), kw) if kw.get("SWAP_AB") else (args, kw))  # stride_ym
    _spec_fails(spec_skinny_gemm.spec_each_row_gets_its_own_product_whatever_is_beside_it,
                "rows mixed up|changed with its companions")


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
def test_skinny_gemm_split_sums_dropping_a_split_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The few-rows GEMM split along K: the sums add every split's partial. Planted: the last split's left out (the
    split count taken as the tiles' count of splits, less one)."""
    from prism.ops import skinny_gemm
    from specs import spec_skinny_gemm

    _plant_launch(monkeypatch, skinny_gemm, "_split_sums_kernel",
                  lambda args, kw: (args, {**kw, "SPLIT_K": kw["SPLIT_K"] - 1}))
    _spec_fails(spec_skinny_gemm.spec_each_row_gets_its_own_product_whatever_is_beside_it, "rows mixed up")


def test_shared_prefix_reaching_the_new_tokens_page_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cascade attention: a row's shared prefix must stop before the page of its new token (that page may be the
    one written this step, and the row's own pass must keep at least that token). Planted: the whole run of
    pages equal to the leader's, uncut (rows of one question hold the same pages)."""
    import numpy as np

    from prism.ops import cascade_attention
    from specs import spec_cascade_attention

    def uncut(table, context_lens, page_size):
        leader, prefix = plan(table, context_lens, page_size)
        if not prefix.any():
            return leader, prefix
        same = np.logical_and.accumulate(table == table[leader], axis=1)
        return leader, same.sum(axis=1) * page_size

    plan = cascade_attention.plan_shared_prefix
    monkeypatch.setattr(cascade_attention, "plan_shared_prefix", uncut)
    _spec_fails(spec_cascade_attention.spec_shared_prefix_plan_claims_only_shared_whole_pages, "new token's page")


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
def test_cascade_counting_the_shared_keys_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cascade attention: each row's own pass starts after its shared prefix. Planted: the decode kernel launched
    without SKIP_PREFIX, so the shared keys are attended in both passes."""
    from prism.ops import paged_attention
    from specs import spec_cascade_attention

    _plant_launch(monkeypatch, paged_attention, "_decode_kernel", lambda args, kw: (args, {**kw, "SKIP_PREFIX": False}))
    _spec_fails(spec_cascade_attention.spec_cascade_attention_equals_per_sequence_attention,
                "differs from per-sequence attention")


def test_cascade_leader_by_length_alone_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cascade attention: the leader is the row whose shared pages spare the most reads. Found by review: the first
    version took the row with the most full pages, so one long row sharing only a first page cut every other
    row's prefix to that page. Planted: that choice."""
    import numpy as np

    from prism.ops import cascade_attention
    from specs import spec_cascade_attention

    def longest_row_leads(table, context_lens, page_size):
        ctx = np.asarray(context_lens, dtype=np.int64)
        full = (ctx - 1) // page_size
        if (full > 0).sum() < 2:
            return 0, np.zeros(len(ctx), dtype=np.int64)
        leader = int(full.argmax())
        width = int(full[leader])
        same = np.logical_and.accumulate(table[:, :width] == table[leader, :width], axis=1)
        pages = np.minimum(same.sum(axis=1), full)
        pages[leader] = 0
        if pages.sum() * page_size < cascade_attention.MIN_SAVED_FRACTION * ctx.sum():
            return 0, np.zeros(len(ctx), dtype=np.int64)
        pages[leader] = pages.max()
        return leader, pages * page_size

    monkeypatch.setattr(cascade_attention, "plan_shared_prefix", longest_row_leads)
    _spec_fails(spec_cascade_attention.spec_shared_prefix_plan_claims_only_shared_whole_pages,
                "another row would spare|no shared pass, but")


def test_a_norm_scaled_from_one_block_of_the_row_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plausible bug of the folded norm (session 17, planted, never shipped): the RMSNorm must sum every
    program's partial sum of squares; a launch that passes one count (the first block's) norms the row by a part
    of it."""
    from prism.ops import gemv
    from specs import spec_folded_norms

    if not gemv.HAVE_TRITON:
        pytest.skip("needs Triton")
    monkeypatch.setattr(gemv, "_norm_args", lambda row, unused: (row.sumsq, 1) if row is not None else (unused, 1))
    _spec_fails(spec_folded_norms.spec_folded_residual_and_norm_equal_the_unfused_ops, "not close")


if kv_write.HAVE_TRITON:
    import triton
    import triton.language as tl

    from prism.ops.fused_norms import _round

    @triton.jit
    def _input_tile_one_rounding(x_ptr, k, kmask, norm_w_ptr, scale, NORM_IN: tl.constexpr, DTYPE: tl.constexpr):
        # `gemv._input_tile` with the normed value multiplied by the weight before it is rounded
        x = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        if NORM_IN:
            nw = tl.load(norm_w_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            x = _round(x / scale * nw, DTYPE)
        return x


def test_a_folded_norm_missing_a_rounding_step_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plausible bug of the folded norm (session 17's review, planted, never shipped): the normed value multiplied
    by the norm's weight before it is rounded to the activation dtype (one rounding where HF's RMSNorm has two).
    Within every tolerance of the first folded-norm spec; the bitwise one must see it. (The interpreter resolves
    the kernel's helper at run time, so the planted helper takes its place.)"""
    from prism.ops import gemv
    from specs import spec_folded_norms

    if not (kv_write.HAVE_TRITON and kv_write._INTERPRETED):
        pytest.skip("plants a Triton helper: needs the interpreter")
    monkeypatch.setattr(gemv, "_input_tile", _input_tile_one_rounding)
    _spec_fails(spec_folded_norms.spec_folded_norm_rounds_as_the_unfused_norm, "rounds otherwise")
