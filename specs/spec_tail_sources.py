"""Spec of the tail-source search (`kv/tail_sources.py`, REFERENCE §2 invariants 2 and 7): over any set of pages
recorded under one parent (published, grown by decode steps, forgotten on reuse), the vectorized search picks the
same tail page and row count as the row-by-row comparison of token ids and media tags (`common_rows` over every
sibling, the lowest page id among equals), for any query sequence.

Contents are drawn from a small alphabet and two images so that siblings share long prefixes and differ late,
inside and after media runs, which is where a code that dropped a token, a digest or an offset would show.
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from prism.kv.content import MediaSpan, SeqContent
from prism.kv.prefix import PrefixIndex
from prism.kv.tail_sources import row_codes

PAGE = 16
ROOT = b"r" * 16
DIGESTS = (b"a" * 32, b"b" * 32)


@st.composite
def contents(draw: st.DrawFn) -> SeqContent:
    """A sequence of <= 2 pages: text tokens from {1, 2, 3} and up to two image spans (pad token 9), which may be
    adjacent and of the same image: then only their offsets tell their rows from one longer span's."""
    n = draw(st.integers(1, 2 * PAGE))
    tokens = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    media, start = [], draw(st.integers(0, n))
    for _ in range(draw(st.integers(0, 2))):
        if start >= n:
            break
        length = draw(st.integers(1, n - start))
        tokens[start : start + length] = [9] * length
        media.append(MediaSpan(start, length, draw(st.sampled_from(DIGESTS))))
        start += length + draw(st.integers(0, 2))
    return SeqContent(tokens, tuple(media))


def _publish(index: PrefixIndex, page: int, content: SeqContent, rows: int) -> None:
    rows = max(1, min(rows, len(content), PAGE - 1))
    index.publish_partial(page, ROOT, tuple(content.tokens[:rows]), content.media_runs(0, rows))


ONE_IMAGE = SeqContent([9] * 6 + [1], (MediaSpan(0, 6, DIGESTS[0]),))
SAME_IMAGE_TWICE = SeqContent([9] * 6 + [1], (MediaSpan(0, 2, DIGESTS[0]), MediaSpan(2, 4, DIGESTS[0])))


@settings(max_examples=150, deadline=None)
@example(operations=[(0, ONE_IMAGE, 7, "put")], queries=[SAME_IMAGE_TWICE])  # equal tokens, offsets differ from row 2
@given(st.lists(st.tuples(st.integers(0, 11), contents(), st.integers(1, PAGE),
                          st.sampled_from(["put", "grow", "forget"])), min_size=1, max_size=25),
       st.lists(contents(), min_size=1, max_size=4))
def spec_vectorized_tail_search_equals_row_by_row(operations, queries) -> None:
    index = PrefixIndex(PAGE)
    for page, content, rows, op in operations:
        record = index.record(page)
        if op == "forget":
            index.forget_page(page)
        elif op == "grow" and record is not None and record.key is None:
            # the same page computed further: its sequence continues the recorded rows (and their media runs)
            spans = tuple(MediaSpan(run.row, run.length, run.digest) for run in record.media)
            grown = SeqContent(list(record.tokens) + content.tokens, spans)
            _publish(index, page, grown, len(record.tokens) + rows)
        else:
            index.forget_page(page)
            _publish(index, page, content, rows)
    siblings = index._children.get(ROOT)
    for query in queries:
        limit = min(PAGE, len(query))
        want = (index._best_tail_by_rows(siblings, query, 0, limit) if siblings is not None else (None, 0))
        got = (siblings.best(row_codes(query.tokens[:limit], query.media_runs(0, limit)))
               if siblings is not None else (None, 0))
        assert got == want, f"vectorized tail search {got} != row by row {want}"
        hit = index.lookup(query, ROOT, max(1, len(query) - 1))
        assert hit.tail_rows <= want[1] or hit.shared_pages, "the lookup reused more rows than any sibling shares"
