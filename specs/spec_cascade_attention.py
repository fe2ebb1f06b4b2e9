"""Spec of cascade decode attention (`ops/cascade_attention.py`): a prefix that rows share is read once for all of
them, and nothing else changes.

1. The host plan claims for each row only whole pages that the row and the leader both hold at the start of
   their block tables, below the row's new token (so the row's own pass keeps at least that token), and
   the whole such run (checked row by row against the tables); the leader's is the longest run any other row
   shares; the leader is the row that spares the most key reads, and there is a shared pass exactly when
   that sparing reaches `MIN_SAVED_FRACTION` of the step's reads.
2. The three launches (shared pass, each row's own keys, merge) give the per-sequence attention of the torch
   reference for any sharing pattern: rows on the same pages as others (the tokens of one question), on a
   prefix of another's pages, on pages of their own, and one-token padding rows (the Triton interpreter).

Page ids are drawn from a small range that includes 0, so a table's zero padding looks like a real page.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.engine.cuda_graphs import page_table
from prism.kv.fp8 import KVLayout, KVPool
from prism.ops import cascade_attention as ca
from prism.ops import kv_write as kw
from prism.ops import paged_attention as pa
from prism.ops.attention_metadata import PagedAttentionMetadata, SharedPrefix
from prism.testing.knobs import module_knobs

PAGE = 4
NUM_PAGES = 40
# the Triton interpreter turns 1-element arrays into loop bounds; NumPy deprecates that (not our code)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@st.composite
def decode_rows(draw: st.DrawFn, max_rows: int = 6) -> list[tuple[list[int], int]]:
    """(pages, context) per row. Each row takes a prefix of one of two shared page runs (or none) then pages of
    its own, or repeats an earlier row's pages with a context of its own (one question's tokens)."""
    free = draw(st.permutations(range(NUM_PAGES)))
    runs = [free[:6], free[6:12]]
    own = iter(free[12:])
    rows: list[tuple[list[int], int]] = []
    for _ in range(draw(st.integers(1, max_rows))):
        kind = draw(st.sampled_from(["run", "run", "own", "same", "padding"]))
        if kind == "same" and rows:
            pages = rows[draw(st.integers(0, len(rows) - 1))][0]
            taken = {c for p, c in rows if p is pages}
            free_positions = [c for c in range((len(pages) - 1) * PAGE + 1, len(pages) * PAGE + 1) if c not in taken]
            if free_positions:  # one question's tokens: the same pages, each its own position
                rows.append((pages, draw(st.sampled_from(free_positions))))
            continue
        if kind == "padding":
            rows.append(([next(own)], 1))
            continue
        else:
            shared = draw(st.integers(0, 6)) if kind == "run" else 0
            pages = runs[draw(st.integers(0, 1))][:shared] + [next(own) for _ in range(draw(st.integers(1, 2)))]
        rows.append((pages, draw(st.integers((len(pages) - 1) * PAGE + 1, len(pages) * PAGE))))
    return rows


def _plan(rows):
    tables = [t for t, _ in rows]
    table = page_table(tables, max(map(len, tables)) + 1)  # one column of padding past the longest
    context = np.array([c for _, c in rows])
    leader, prefix = ca.plan_shared_prefix(table, context, PAGE)
    return table, context, leader, prefix


def _spared_pages(table: np.ndarray, full: np.ndarray, leader: int) -> list[int]:
    """Row by row: the whole pages each other row holds in common with `leader` from the start, below both
    rows' new tokens (what a shared pass led by `leader` would read for them)."""
    out = []
    for r in range(len(full)):
        run = 0
        while r != leader and run < min(full[r], full[leader]) and table[r, run] == table[leader, run]:
            run += 1
        out.append(run)
    return out


@settings(max_examples=300, deadline=None)
@given(decode_rows())
def spec_shared_prefix_plan_claims_only_shared_whole_pages(rows) -> None:
    table, context, leader, prefix = _plan(rows)
    full = (context - 1) // PAGE  # whole pages before each row's new token
    assert prefix.dtype == np.int64 and prefix.shape == (len(rows),)
    assert (prefix % PAGE == 0).all(), f"prefix not in whole pages: {prefix}"
    pages = prefix // PAGE
    assert (pages <= full).all(), f"a row's shared pass would read its new token's page: {prefix} for contexts {context}"
    assert len(rows) <= ca.MAX_LEADER_CANDIDATES  # so every row is a candidate and the best leader is known
    best = max((sum(_spared_pages(table, full, lead)) for lead in range(len(rows))), default=0)
    worth = best * PAGE >= ca.MIN_SAVED_FRACTION * context.sum()
    if not pages.any():
        assert not worth, f"no shared pass, but a leader would spare {best} pages of {context.sum() / PAGE:.0f}"
        return
    assert worth, f"a shared pass sparing {best} pages of {context.sum() / PAGE:.0f}"
    lead = table[leader]
    for r in range(len(rows)):
        assert (table[r, : pages[r]] == lead[: pages[r]]).all(), f"row {r} claims pages it does not share"
    spared = _spared_pages(table, full, leader)
    others = [pages[r] for r in range(len(rows)) if r != leader]
    assert others == [spared[r] for r in range(len(rows)) if r != leader], \
        f"the plan's prefixes {pages.tolist()} are not the pages each row shares with leader {leader}: {spared}"
    assert pages[leader] == max(others), f"the leader's prefix {pages[leader]} != the longest other {max(others)}"
    assert sum(spared) == best, f"leader {leader} spares {sum(spared)} pages, another row would spare {best}"


@settings(max_examples=40, deadline=None)
@given(decode_rows(max_rows=5), st.sampled_from(["fp8", "fp32"]), st.sampled_from([1, 2]), st.integers(1, 2),
       st.integers(1, 4), st.integers(0, 2**16))
def spec_cascade_attention_equals_per_sequence_attention(rows, kv_dtype, group, tail_splits, shared_splits,
                                                         seed) -> None:
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, page_size=PAGE, num_pages=NUM_PAGES, kv_dtype=kv_dtype)
    pool = KVPool.allocate(lay, "cpu")
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(NUM_PAGES * PAGE)
    kw.write_kv_reference(pool, 0, slots, torch.randn(len(slots), 2, 16, generator=g) * 3,
                          torch.randn(len(slots), 2, 16, generator=g))
    meta = PagedAttentionMetadata.build([1] * len(rows), [c for _, c in rows], [t for t, _ in rows], PAGE)
    _, _, leader, prefix = _plan(rows)
    cascade = dataclasses.replace(meta, shared_prefix=SharedPrefix(torch.tensor(prefix), torch.tensor([leader]),
                                                                   shared_splits))
    q = torch.randn(len(rows), 2 * group, 16, generator=g)
    want = pa.paged_attention_reference(q, pool, 0, meta)
    # the smallest tl.dot tile: contexts of up to 32 keys span several splits
    with module_knobs(pa, {"_BLOCK_N": 16}), module_knobs(ca, {"BLOCK_N": 16}):
        got = pa.paged_decode_attention(q, pool, 0, cascade, use_triton=True, num_splits=tail_splits)
    err = float((got - want).abs().max())
    assert err <= 1e-5, f"cascade attention differs from per-sequence attention by {err} (prefixes {prefix.tolist()})"
