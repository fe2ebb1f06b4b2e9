"""Steps as one-token rows (`engine/cuda_graphs.py`): what the CUDA graphs replay for decodes and for short
prefills after a prefix hit. On the CPU the same rows run eagerly on the same static buffers, so these tests
check the row construction (slots, per-row context lengths, positions, padding, which logits come back)
against the packed forward through the paged pool, on the tiny checkpoint in fp32 with scaled-FP8 KV."""

from __future__ import annotations

import pytest
import torch

from prism.engine.cuda_graphs import _PREFIX, GraphRows, RowGraphs
from prism.engine.step_payload import PieceInput
from prism.kv.fp8 import KVLayout, KVPool
from prism.model.loading import load_model
from prism.ops.attention_metadata import PagedAttentionMetadata
from prism.ops.paged_attention import PagedKVBackend
from prism.testing.checkpoints import ensure_tiny_checkpoint

PAGE = 4
PAGES = 40
SCRATCH = 32  # pages 32.. are the graphs' scratch; sequences use pages below


@pytest.fixture(scope="module")
def model():
    return load_model(ensure_tiny_checkpoint(), dtype=torch.float32)


def piece(token_ids, start, pages, sample=True) -> PieceInput:
    end = start + len(token_ids)
    positions = torch.arange(start, end, dtype=torch.int64).expand(3, -1).clone()
    return PieceInput(list(token_ids), positions, start, end, 0, list(pages), sample)


def packed_forward(model, pool, pieces, media=None):
    """The eager packed step (`ModelRunner._forward`'s computation): logits of the sampling pieces' last rows;
    `media`: `MultimodalEmbeddings` placed at their rows."""
    meta = PagedAttentionMetadata.build([p.end - p.start for p in pieces], [p.end for p in pieces],
                                        [p.pages for p in pieces], PAGE)
    rows, offset = [], 0
    for p in pieces:
        offset += p.end - p.start
        if p.sample:
            rows.append(offset - 1)
    ids = torch.tensor([t for p in pieces for t in p.token_ids])
    positions = torch.cat([p.positions for p in pieces], dim=1)
    with torch.inference_mode():
        return model(ids, positions, PagedKVBackend(pool, meta), multimodal=media,
                     logits_indices=torch.tensor(rows)).float()


def snapshot(pool: KVPool):
    return [t.clone() for t in (pool.payload, pool.scales)]


def restore(pool: KVPool, saved) -> None:
    pool.payload.copy_(saved[0])
    pool.scales.copy_(saved[1])


def setup(model, cascade_min_batch: int = 0):
    text = model.config.text
    layout = KVLayout(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, PAGE, PAGES, "fp8")
    pool = KVPool.allocate(layout)
    pool.payload.zero_()
    pool.scales.zero_()
    graphs = RowGraphs(model, pool, SCRATCH, max_batch=16, max_model_len=SCRATCH * PAGE,
                       cascade_min_batch=cascade_min_batch)
    graphs.capture()  # nothing on the CPU
    gen = torch.Generator().manual_seed(0)
    vocab = text.vocab_size

    def tokens(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    # Three sequences with cached prefixes on scattered pages: A (10 tokens), B (7), C (3).
    a_pages, b_pages, c_pages = [3, 7, 11, 20], [1, 5], [9]
    prefix = [piece(tokens(10), 0, a_pages), piece(tokens(7), 0, b_pages), piece(tokens(3), 0, c_pages)]
    packed_forward(model, pool, prefix)
    return pool, graphs, tokens, (a_pages, b_pages, c_pages)


def test_a_question_after_a_prefix_as_rows_equals_the_packed_prefill(model):
    pool, graphs, tokens, (a_pages, _, _) = setup(model)
    question = [piece(tokens(5), 10, a_pages)]  # positions 10..14: crosses into page 20
    saved = snapshot(pool)
    expected = packed_forward(model, pool, question)
    restore(pool, saved)
    rows = GraphRows.from_pieces(question, PAGE)
    assert rows.context_lens.tolist() == [11, 12, 13, 14, 15] and rows.sample_rows == [4]
    assert rows.slots.tolist() == [11 * PAGE + 2, 11 * PAGE + 3, 20 * PAGE, 20 * PAGE + 1, 20 * PAGE + 2]
    got = graphs.run(rows)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_decodes_and_a_prefill_in_one_padded_step(model):
    pool, graphs, tokens, (a_pages, b_pages, c_pages) = setup(model)
    # B decodes one token, A adds 5 tokens without sampling (a chunk), C decodes: sampled rows 0 and 6,
    # 7 rows in the bucket of 8 (one padding row).
    step = [piece(tokens(1), 7, b_pages), piece(tokens(5), 10, a_pages, sample=False),
            piece(tokens(1), 3, c_pages)]
    saved = snapshot(pool)
    expected = packed_forward(model, pool, step)
    restore(pool, saved)
    rows = GraphRows.from_pieces(step, PAGE)
    assert rows.sample_rows == [0, 6] and rows.row_piece.tolist() == [0, 1, 1, 1, 1, 1, 2]
    got = graphs.run(rows)
    assert got.shape == expected.shape == (2, model.config.text.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # Outside the scratch pages, the KV the rows wrote is the KV the packed step wrote.
    after_rows = snapshot(pool)
    restore(pool, saved)
    packed_forward(model, pool, step)
    assert pool.scales.shape[2] == PAGES
    torch.testing.assert_close(after_rows[1][:, :, :SCRATCH], pool.scales[:, :, :SCRATCH], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after_rows[0][:, :, :SCRATCH].view(torch.uint8).int(),
                               pool.payload[:, :, :SCRATCH].view(torch.uint8).int(), rtol=0, atol=1)


def test_rows_that_do_not_fit_are_refused(model):
    pool, graphs, tokens, (a_pages, *_) = setup(model)
    with pytest.raises(ValueError, match="do not fit"):
        graphs.run(GraphRows.from_pieces([piece(tokens(17), 10, a_pages + [21, 22, 23])], PAGE))
    padded = PieceInput([1], torch.zeros(3, 4, dtype=torch.int64), 0, 1, 3, [0], True)
    with pytest.raises(ValueError, match="padded"):
        GraphRows.from_pieces([padded], PAGE)


def test_prefills_that_would_reread_long_contexts_stay_eager(model, monkeypatch):
    """As rows, each prefill token reads its whole context alone: past a budget of key reads the step runs
    eagerly (the prefill kernel shares key tiles); decode rows are never refused for it."""
    from types import SimpleNamespace

    from prism.engine import runner

    pool, graphs, tokens, (a_pages, b_pages, c_pages) = setup(model)
    fake = SimpleNamespace(graphs=graphs, packed=None, deterministic=False)  # no packed graphs: the rows are the only graphs
    question = [piece(tokens(5), 10, a_pages)]  # 5 tokens x context 15 = 75 key reads
    decodes = [piece(tokens(1), 7, b_pages), piece(tokens(1), 3, c_pages)]
    graph_for = runner.ModelRunner._graph_for
    assert graph_for(fake, question + decodes, []) == "rows"
    monkeypatch.setattr(runner, "MAX_GRAPH_PREFILL_KEY_READS", 74)
    assert graph_for(fake, question + decodes, []) == ""
    assert graph_for(fake, decodes, []) == "rows"
    assert graph_for(fake, decodes, ["a media slice"]) == "", "media tokens never run as rows"


def test_padding_rows_write_only_scratch_slots_after_a_larger_step(model):
    """A step padded up to its bucket must leave every page outside the scratch pages as it was, except the
    step's own slots, also right after a larger step filled those rows with real slots."""
    pool, graphs, tokens, (a_pages, b_pages, c_pages) = setup(model)
    graphs.run(GraphRows.from_pieces([piece(tokens(5), 10, a_pages), piece(tokens(1), 7, b_pages),
                                      piece(tokens(1), 3, c_pages)], PAGE))  # 7 rows: bucket 8
    before = snapshot(pool)
    rows = GraphRows.from_pieces([piece(tokens(1), 15, a_pages), piece(tokens(1), 8, b_pages + [30]),
                                  piece(tokens(1), 4, c_pages + [31])], PAGE)  # 3 rows: bucket 4, one padding row
    graphs.run(rows)
    changed = (pool.scales != before[1]).flatten(0, 1).any(0).any(-1)  # [pages, rows in page]
    changed[SCRATCH:] = False
    written = {(int(s) // PAGE, int(s) % PAGE) for s in rows.slots}
    assert {tuple(ix) for ix in changed.nonzero().tolist()} <= written, "a padding row wrote a sequence's page"


def test_cascade_buffers_follow_each_steps_plan(model):
    """Cascade attention's row buffers (from review): a step of a cascade bucket whose rows share pages gets each
    row's prefix and the leader (padding rows 0); a later step of the same bucket sharing nothing leaves no stale
    prefix; a step below the cascade buckets keeps zeros. Each step's logits are the packed forward's."""
    pool, graphs, tokens, (a_pages, b_pages, c_pages) = setup(model, cascade_min_batch=4)
    prefix_row = graphs.row_inputs[_PREFIX]
    # three sequences forked from A's first two pages (positions 8 and 9 on pages of their own) beside A itself
    shared = [piece(tokens(1), 10, a_pages), piece(tokens(1), 9, a_pages[:2] + [30]),
              piece(tokens(1), 8, a_pages[:2] + [31]), piece(tokens(1), 8, a_pages[:2] + [29])]
    saved = snapshot(pool)
    want = packed_forward(model, pool, shared)
    restore(pool, saved)
    got = graphs.run(GraphRows.from_pieces(shared, PAGE))  # bucket 4, full
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert prefix_row[:4].tolist() == [8, 8, 8, 8] and int(graphs.leader[0]) in range(4)
    assert graphs.shared_prefix_steps == 1
    apart = [piece(tokens(1), 11, a_pages), piece(tokens(1), 7, b_pages), piece(tokens(1), 3, c_pages)]
    graphs.run(GraphRows.from_pieces(apart, PAGE))  # bucket 4: three rows and a padding row
    assert prefix_row[:4].tolist() == [0, 0, 0, 0] and graphs.shared_prefix_steps == 1
    graphs.run(GraphRows.from_pieces(shared[2:], PAGE))  # two sharing rows, bucket 2: below the cascade buckets
    assert prefix_row[:2].tolist() == [0, 0] and graphs.shared_prefix_steps == 1
