"""Packed CUDA-graph steps (`engine/packed_graphs.py`): the mixed steps (a prefill chunk, a question, decodes,
media tokens) through static buffers padded to a bucket. On the CPU the same buffers run eagerly, so these
tests check the packing (slots, block table, the padding sequence, dense media and DeepStack features, which
logits come back) against the eager packed forward through the paged pool, on the tiny checkpoint in fp32
with scaled-FP8 KV. Planted bugs (stale DeepStack features, a padding sequence in a real page) must fail."""

from __future__ import annotations

import pytest
import torch
from test_graph_rows import PAGE, SCRATCH, piece, restore, setup, snapshot
from test_graph_rows import packed_forward as eager

from prism.engine import packed_graphs as pg
from prism.engine.packed_graphs import PackedGraphs, PackedStep
from prism.engine.step_payload import MediaSlice, PieceInput
from prism.model.loading import load_model
from prism.model.qwen3_vl import MultimodalEmbeddings
from prism.ops.attention_metadata import PagedAttentionMetadata
from prism.ops.paged_attention import PagedKVBackend
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.static_output_graph import stand_in_static_output_graph


@pytest.fixture(scope="module")
def model():
    return load_model(ensure_tiny_checkpoint(), dtype=torch.float32)


def packed(model, pool):
    graphs = PackedGraphs(model, pool, SCRATCH, max_tokens=32, max_seqs=4, max_model_len=SCRATCH * PAGE)
    graphs.capture()  # nothing on the CPU
    return graphs


def written_outside_scratch(pool, before) -> set[tuple[int, int]]:
    """(page, row) of every KV slot outside the scratch pages whose scales changed since `before`."""
    changed = (pool.scales != before[1]).flatten(0, 1).any(0).any(-1)  # [pages, rows in page]
    changed[SCRATCH:] = False
    return {tuple(ix) for ix in changed.nonzero().tolist()}


def own_slots(step: PackedStep) -> set[tuple[int, int]]:
    return {(int(s) // PAGE, int(s) % PAGE) for s in step.slots}


def media_for(model, rows: list[int], seed: int) -> MultimodalEmbeddings:
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.text.hidden_size
    levels = len(model.config.vision.deepstack_visual_indexes)
    return MultimodalEmbeddings(torch.tensor(rows), torch.randn(len(rows), hidden, generator=g),
                                torch.randn(levels, len(rows), hidden, generator=g))


def test_a_mixed_step_equals_the_eager_packed_forward(model):
    pool, _, tokens, (a_pages, b_pages, c_pages) = setup(model)
    graphs = packed(model, pool)
    step = [piece(tokens(1), 7, b_pages), piece(tokens(5), 10, a_pages, sample=False), piece(tokens(1), 3, c_pages)]
    saved = snapshot(pool)
    expected = eager(model, pool, step)
    after_eager = snapshot(pool)
    restore(pool, saved)
    packed_step = PackedStep.from_pieces(step, [], PAGE)
    assert packed_step.sample_rows == [0, 6] and packed_step.query_lens == (1, 5, 1)
    got = graphs.run(packed_step, None)  # 7 tokens: bucket 32, a 25-token padding sequence
    assert got.shape == expected.shape == (2, model.config.text.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Outside the scratch pages the KV written is the eager step's (up to the rounding of other GEMM shapes),
    # and only at the step's own slots: the padding sequence wrote only scratch.
    assert written_outside_scratch(pool, saved) <= own_slots(packed_step)
    torch.testing.assert_close(pool.scales[:, :, :SCRATCH], after_eager[1][:, :, :SCRATCH], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(pool.payload[:, :, :SCRATCH].view(torch.uint8).int(),
                               after_eager[0][:, :, :SCRATCH].view(torch.uint8).int(), rtol=0, atol=1)


def test_media_rows_take_dense_features_and_the_next_step_sees_none(model, monkeypatch):
    """A step with media tokens equals the indexed eager form; the step after it (no media) must not see the
    DeepStack features left in the buffers. Planted bug: not clearing them."""
    pool, _, tokens, (a_pages, b_pages, _) = setup(model)
    graphs = packed(model, pool)
    step = [piece(tokens(5), 10, a_pages), piece(tokens(1), 7, b_pages)]
    media = media_for(model, [1, 2, 3], seed=1)
    saved = snapshot(pool)
    expected = eager(model, pool, step, media)
    restore(pool, saved)
    slices = [MediaSlice(1, b"x", 0, 3)]
    got = graphs.run(PackedStep.from_pieces(step, slices, PAGE), media)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    follow = [piece(tokens(1), 15, a_pages), piece(tokens(3), 8, b_pages + [30])]
    restore(pool, saved)
    eager(model, pool, step, media)
    saved = snapshot(pool)
    expected = eager(model, pool, follow)
    restore(pool, saved)
    torch.testing.assert_close(graphs.run(PackedStep.from_pieces(follow, [], PAGE), None), expected,
                               rtol=1e-5, atol=1e-5)

    # Planted: the buffers keep the last media step's DeepStack features.
    restore(pool, saved)
    graphs.run(PackedStep.from_pieces(step, slices, PAGE), media)
    restore(pool, saved)
    monkeypatch.setattr(graphs, "_deepstack_dirty", 0)
    stale = graphs.run(PackedStep.from_pieces(follow, [], PAGE), None)
    assert (stale - expected).abs().max() > 1e-3, "stale DeepStack features went unnoticed"


def test_a_padding_sequence_in_a_real_page_is_caught(model, monkeypatch):
    """Planted bug: the padding sequence's scratch starts at page 20 (sequence A's): the KV check fails."""
    pool, _, tokens, (a_pages, b_pages, c_pages) = setup(model)
    graphs = packed(model, pool)
    shift = (SCRATCH - a_pages[-1]) * PAGE
    monkeypatch.setattr(graphs, "scratch_slots", graphs.scratch_slots - shift)
    monkeypatch.setattr(graphs, "scratch_pages", [p - shift // PAGE for p in graphs.scratch_pages])
    before = snapshot(pool)
    step = PackedStep.from_pieces([piece(tokens(1), 3, c_pages)], [], PAGE)
    graphs.run(step, None)
    assert not written_outside_scratch(pool, before) <= own_slots(step)


def test_steps_that_do_not_fit_are_refused(model):
    pool, _, tokens, (a_pages, b_pages, c_pages) = setup(model)
    graphs = packed(model, pool)
    assert graphs.buckets == (32,) and not graphs.fits(33, 1, 10) and not graphs.fits(8, 5, 10)
    five = [piece(tokens(1), 3, c_pages)] * 5
    with pytest.raises(ValueError, match="do not fit"):
        graphs.run(PackedStep.from_pieces(five, [], PAGE), None)
    assert PackedGraphs(model, pool, SCRATCH, max_tokens=100, max_seqs=4, max_model_len=SCRATCH * PAGE).buckets \
        == tuple(b for b in pg.BUCKETS if b < 100) + (100,)


def test_a_deterministic_tile_is_one_page_of_its_own_rows(model):
    """Deterministic mode's forward: one sequence's tile of a whole page, its filler rows (id 0, the positions and
    slots after its end) part of its query, run in a bucket of exactly a page: no padding sequence, the eager padded
    forward's logits at the last real row."""
    pool, _, tokens, (a_pages, _, _) = setup(model)
    graphs = PackedGraphs(model, pool, SCRATCH, max_tokens=PAGE, max_seqs=1, max_model_len=SCRATCH * PAGE,
                          buckets=(PAGE,))
    real = tokens(3)  # positions 8..10 of A (page 11), then one filler row
    positions = torch.arange(8, 12, dtype=torch.int64).expand(3, -1).clone()
    step = PackedStep.from_pieces([PieceInput(real, positions, 8, 11, 1, a_pages, True)], [], PAGE)
    assert step.token_ids.tolist() == [*real, 0] and step.sample_rows == [2]
    assert step.query_lens == (4,) and step.context_lens == (12,)
    assert step.slots.tolist() == [11 * PAGE + r for r in range(PAGE)]
    saved = snapshot(pool)
    meta = PagedAttentionMetadata.build([4], [12], [a_pages], PAGE)
    with torch.inference_mode():
        expected = model(torch.tensor([*real, 0]), positions, PagedKVBackend(pool, meta),
                         logits_indices=torch.tensor([2])).float()
    restore(pool, saved)
    assert graphs._fill(step, None) == (PAGE, ((4,), (12,)))  # the bucket, and no padding sequence
    restore(pool, saved)
    torch.testing.assert_close(graphs.run(step, None), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="buckets must be"):
        PackedGraphs(model, pool, SCRATCH, max_tokens=PAGE, max_seqs=1, max_model_len=SCRATCH * PAGE,
                     buckets=(2 * PAGE,))


def test_a_replays_logits_are_the_callers_not_the_graphs_output_buffer(model):
    """Found in review (session 25): a replay's fp32 logits were a view of the bucket's static output, so the next
    replay overwrote them; deterministic mode replays the bucket once per tile and concatenates the sampling tiles'
    logits after the last one (with fp32 weights on CUDA every sequence of a step read the last tile's logits).
    Here a stand-in graph writes the eager forward into a static output buffer, as a replay does."""
    pool, _, tokens, (a_pages, b_pages, _) = setup(model)
    graphs = PackedGraphs(model, pool, SCRATCH, max_tokens=PAGE, max_seqs=1, max_model_len=SCRATCH * PAGE,
                          buckets=(PAGE,))
    stand_in_static_output_graph(graphs, PAGE, rows=2)
    assert model.dtype == torch.float32
    positions = torch.arange(12, 16, dtype=torch.int64).expand(3, -1).clone()
    tile = PieceInput(tokens(3), positions, 12, 15, 1, a_pages, True)  # positions 12..14 of A, one filler row
    first = graphs.run(PackedStep.from_pieces([tile], [], PAGE), None)
    kept = first.clone()
    graphs.run(PackedStep.from_pieces([piece(tokens(4), 4, b_pages)], [], PAGE), None)
    assert torch.equal(first, kept), "the next replay overwrote the logits a tile returned"


# The Triton interpreter's own `int(array)` on loaded scalars (triton/runtime/interpreter.py), ~4,600 times here.
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
def test_the_captured_form_with_the_triton_kernels_equals_the_eager_step(model, monkeypatch):  # noqa: F811
    """What the GPU replays: the buffers filled by `_fill`, then the forward with the *placeholder* host lengths
    (one sequence of `bucket` tokens at the longest context), through the Triton kernels (interpreter), which
    read the real lengths, block list and split count from the buffers. Mixed, media, and after-media steps."""
    from prism.ops.kv_write import HAVE_TRITON

    if not HAVE_TRITON:
        pytest.skip("triton not installed")
    original = pg.PagedKVBackend
    monkeypatch.setattr(pg, "PagedKVBackend", lambda *a, **k: original(*a, use_triton=True, **k))
    pool, _, tokens, (a_pages, b_pages, c_pages) = setup(model)
    # A long max_model_len: the buckets' fixed key splits assume the longest context, so they split the keys.
    graphs = PackedGraphs(model, pool, SCRATCH, max_tokens=32, max_seqs=4, max_model_len=4096)
    assert graphs.splits(32) > 1, "the bucket's fixed key split must be exercised"

    def captured(step, media=None):
        bucket, _ = graphs._fill(step, media)
        with torch.inference_mode():
            return graphs._forward(bucket, None)[: len(step.sample_rows)].float()

    cases = [
        ([piece(tokens(1), 7, b_pages), piece(tokens(5), 10, a_pages), piece(tokens(1), 3, c_pages)], None, []),
        ([piece(tokens(5), 10, a_pages), piece(tokens(1), 7, b_pages)], [1, 2, 3], [MediaSlice(1, b"x", 0, 3)]),
        ([piece(tokens(1), 15, a_pages), piece(tokens(3), 8, b_pages + [30])], None, []),
    ]
    for pieces, rows, slices in cases:
        media = media_for(model, rows, seed=2) if rows else None
        saved = snapshot(pool)
        expected = eager(model, pool, pieces, media)
        restore(pool, saved)
        got = captured(PackedStep.from_pieces(pieces, slices, PAGE), media)
        restore(pool, saved)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
