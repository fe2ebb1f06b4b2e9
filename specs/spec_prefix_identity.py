"""Spec of prefix identity (REFERENCE §2, invariant 7) at the level of keys and the index.

- Page keys are injective over page content: different (parent, tokens, media runs) give different keys,
  including near misses built to collide under a careless serialization (token digits that concatenate
  alike, the same image at another offset, the same placeholders with other pixels).
- The index never returns a page whose stored content differs from the query, whatever the hash does:
  every hit is verified against the stored parent, tokens and media.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.kv.content import MediaRun, MediaSpan, SeqContent
from prism.kv.keys import page_key, root_key
from prism.kv.prefix import PrefixIndex

DIGESTS = [bytes([d]) * 16 for d in (0xA1, 0xB2)] + [bytes([0xA1]) * 15 + b"\x00"]


@st.composite
def page_contents(draw: st.DrawFn, size: int = 4) -> tuple[bytes, tuple[int, ...], tuple[MediaRun, ...]]:
    parent = draw(st.sampled_from([root_key("a"), root_key("b")]))
    tokens = tuple(draw(st.lists(st.integers(0, 20), min_size=size, max_size=size)))
    media: tuple[MediaRun, ...] = ()
    if draw(st.booleans()):
        row = draw(st.integers(0, size - 1))
        length = draw(st.integers(1, size - row))
        media = (MediaRun(row, length, draw(st.sampled_from(DIGESTS)), draw(st.integers(0, 3))),)
    return parent, tokens, media


@settings(max_examples=400)
@given(a=page_contents(), b=page_contents())
def spec_page_keys_are_injective(a, b) -> None:
    if a != b:
        assert page_key(*a) != page_key(*b), f"two different pages share a key: {a} vs {b}"


@given(a=page_contents())
def spec_same_page_same_key(a) -> None:
    """A page's key is a function of its content alone, not of the objects carrying it: the same page given as a
    list, as numpy integers (what a prompt's token array holds), with its media runs rebuilt, gets the same key.
    (It compared a key with itself, which no plausible bug fails: review of the specs, session 28.)"""
    parent, tokens, media = a
    rebuilt = tuple(MediaRun(*run) for run in media)
    want = page_key(parent, tokens, media)
    assert page_key(bytes(parent), list(tokens), list(rebuilt)) == want, "another container, another key"
    assert page_key(parent, np.asarray(tokens, dtype=np.int64), rebuilt) == want, "numpy ints, another key"
    assert page_key(parent, [np.int32(t) for t in tokens], media) == want, "numpy scalars, another key"


def _publish_many(index: PrefixIndex, pages: list[tuple[int, ...]], root: bytes) -> None:
    """Publish single-page chains directly under the root, one physical page each."""
    for page, tokens in enumerate(pages):
        index.publish_full(page, root, tokens, ())


@settings(max_examples=200)
@given(
    stored=st.lists(st.tuples(*[st.integers(0, 6)] * 2), min_size=1, max_size=40, unique=True),
    queries=st.lists(st.tuples(*[st.integers(0, 6)] * 2), min_size=1, max_size=40),
)
def spec_lookup_returns_only_verified_content(stored, queries) -> None:
    index = PrefixIndex(page_size=2)
    root = root_key("m")
    _publish_many(index, stored, root)
    for query in queries:
        content = SeqContent([*query, 0])  # one extra token so a whole-page hit is allowed
        hit = index.lookup(content, root, len(content) - 1)
        for page in hit.shared_pages:
            record = index.record(page)
            assert record is not None and record.tokens == tuple(query), (
                f"query {query} was served page {page} holding {record.tokens if record else None}"
            )


@given(st.integers(1, 6), st.sampled_from(DIGESTS[:2]), st.sampled_from(DIGESTS[:2]))
def spec_same_placeholders_other_pixels_never_hit(length: int, first: bytes, second: bytes) -> None:
    """Identical placeholder tokens only share KV when the media digests are identical."""
    index = PrefixIndex(page_size=2)
    root = root_key("m")
    tokens = [7] * length + [1, 2]
    a = SeqContent(tokens, (MediaSpan(0, length, first),))
    for j in range(len(tokens) // 2):
        index.publish_full(j, index_parent(index, a, root, j), tuple(tokens[2 * j : 2 * j + 2]), a.media_runs(2 * j, 2 * j + 2))
    b = SeqContent(list(tokens), (MediaSpan(0, length, second),))
    hit = index.lookup(b, root, len(b) - 1)
    if first != second:
        assert hit.num_tokens == 0, "an image with other pixels reused KV"
    else:
        assert hit.num_tokens > 0


def index_parent(index: PrefixIndex, content: SeqContent, root: bytes, page: int) -> bytes:
    parent = root
    for j in range(page):
        parent = page_key(parent, tuple(content.tokens[2 * j : 2 * j + 2]), content.media_runs(2 * j, 2 * j + 2))
    return parent
