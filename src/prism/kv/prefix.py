"""The prefix index: which computed pages can be found by content, and the lookup rules.

Owns four invariants of REFERENCE §2:
- *Publish after compute* (1): records are only written by `publish_full` / `publish_partial`, which the
  manager calls from `publish_computed`, over rows a finished step computed. Nothing else adds records.
- *Prefix identity* (7): a full page is found by its chained key and then verified against the stored
  parent, tokens and media runs; a tail source is a child of the verified parent whose stored rows match.
- *Tail page without the old key* (2): a boundary inside a page yields a `PrefixHit.tail_source` to copy
  rows from, never a shared page; the lookup snaps a boundary inside an image down to the image start.
- *>= 1 computed token* (8): callers pass `max_tokens = len(prompt) - 1`.

A record lives until its page is handed out again by the pool (`forget_page`), so freed pages stay
revivable (lazy retention).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .content import MediaRun, SeqContent
from .keys import page_chain, page_key
from .tail_sources import TailSources, row_codes


@dataclass(frozen=True)
class PageRecord:
    """What a computed page holds: rows [0, len(tokens)) computed after the page chain `parent`."""

    page: int
    parent: bytes
    tokens: tuple[int, ...]
    media: tuple[MediaRun, ...]
    key: bytes | None  # only full pages have a key


@dataclass(frozen=True)
class PrefixHit:
    """The reusable prefix of a sequence: `shared_pages` are attached read-only, then `tail_rows` rows
    are copied from `tail_source` into a private page. `keys` are the chain keys of the shared pages."""

    shared_pages: tuple[int, ...]
    keys: tuple[bytes, ...]
    tail_source: int | None
    tail_rows: int
    page_size: int
    # What the KV manager found it for: (`PrefixIndex.version` then, content length, reuse mode); None if unknown.
    # A hit is reused only for the same query on an unchanged index.
    found_for: tuple[int, int, str] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.shared_pages) * self.page_size + self.tail_rows

    @property
    def pages_read(self) -> tuple[int, ...]:
        return self.shared_pages + ((self.tail_source,) if self.tail_source is not None else ())


def _row_tags(media: tuple[MediaRun, ...], rows: int) -> list[tuple[bytes, int] | None]:
    tags: list[tuple[bytes, int] | None] = [None] * rows
    for run in media:
        for r in range(run.row, min(run.row + run.length, rows)):
            tags[r] = (run.digest, run.offset + r - run.row)
    return tags


def common_rows(record: PageRecord, content: SeqContent, start: int, limit: int) -> int:
    """How many leading rows of `record` equal positions [start, start + limit) of `content`."""
    n = min(limit, len(record.tokens))
    query = content.tokens[start : start + n]
    same = 0
    while same < n and record.tokens[same] == query[same]:
        same += 1
    if same == 0:
        return 0
    stored_tags = _row_tags(record.media, same)
    query_tags = _row_tags(content.media_runs(start, start + same), same)
    for r in range(same):
        if stored_tags[r] != query_tags[r]:
            return r
    return same


class PrefixIndex:
    """Key -> full page, page -> record, parent key -> candidate tail sources."""

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self._by_key: dict[bytes, PageRecord] = {}
        self._by_page: dict[int, PageRecord] = {}
        self._children: dict[bytes, TailSources] = {}  # parent key -> the pages recorded after it
        self.version = 0  # counts every change of what a lookup can return
        self._media_pages: Counter[bytes] = Counter()  # media digest -> recorded pages holding rows of it

    def __len__(self) -> int:
        return len(self._by_page)

    def record(self, page: int) -> PageRecord | None:
        return self._by_page.get(page)

    def records(self) -> list[PageRecord]:
        return list(self._by_page.values())

    def is_findable(self, page: int) -> bool:
        return page in self._by_page

    def holds_media(self, digest: bytes) -> bool:
        """Whether some recorded page holds rows of the media item `digest` (a prompt showing it may hit them)."""
        return digest in self._media_pages

    def check_media_counts(self) -> None:
        """`holds_media` agrees with a recount over the records."""
        recount = Counter(d for r in self._by_page.values() for d in {run.digest for run in r.media})
        if recount != self._media_pages:
            raise AssertionError("the index's media digests disagree with its records")

    # -- publishing: only ever called by the manager's publish_computed ---------------------------
    def publish_full(self, page: int, parent: bytes, tokens: tuple[int, ...], media: tuple[MediaRun, ...]) -> bytes:
        """Make a full, computed page findable by key. Returns the key (the next page's parent).

        If another page already holds this exact content it stays the findable one; `page` then only
        continues the chain (its key is still returned) and is not recorded.
        """
        if len(tokens) != self.page_size:
            raise ValueError(f"publish_full needs {self.page_size} rows, got {len(tokens)}")
        key = page_key(parent, tokens, media)
        holder = self._by_key.get(key)
        if holder is not None and holder.page != page:
            return key
        self.forget_page(page)
        record = PageRecord(page, parent, tokens, media, key)
        self._by_key[key] = record
        self._add(record)
        self.version += 1
        return key

    def publish_partial(self, page: int, parent: bytes, tokens: tuple[int, ...], media: tuple[MediaRun, ...]) -> None:
        """Offer the computed rows of a partly filled page as a tail source (no key)."""
        if not 0 < len(tokens) < self.page_size:
            raise ValueError(f"publish_partial needs 1..{self.page_size - 1} rows, got {len(tokens)}")
        old = self._by_page.get(page)
        if old is not None and (old.key is not None or old.parent != parent or len(old.tokens) >= len(tokens)):
            return
        # The same page grown by the rows computed since (its recorded rows unchanged): code only the new rows.
        self.version += 1
        if old is not None and tokens[: len(old.tokens)] == old.tokens and all(run in media for run in old.media):
            self._count_media(old, -1)
            self._by_page[page] = PageRecord(page, parent, tokens, media, None)
            self._count_media(self._by_page[page], +1)
            self._children[parent].put(page, tokens, media, known_rows=len(old.tokens))
            return
        self.forget_page(page)
        self._add(PageRecord(page, parent, tokens, media, None))

    def _count_media(self, record: PageRecord, sign: int) -> None:
        for digest in {run.digest for run in record.media}:
            self._media_pages[digest] += sign
            if not self._media_pages[digest]:
                del self._media_pages[digest]

    def _add(self, record: PageRecord) -> None:
        self._by_page[record.page] = record
        self._count_media(record, +1)
        siblings = self._children.get(record.parent)
        if siblings is None:
            siblings = self._children[record.parent] = TailSources(self.page_size)
        siblings.put(record.page, record.tokens, record.media)

    def forget_page(self, page: int) -> None:
        """The page's contents are about to be overwritten (pool reuse): drop every record of it."""
        record = self._by_page.pop(page, None)
        if record is None:
            return
        self.version += 1
        self._count_media(record, -1)
        if record.key is not None and self._by_key.get(record.key) is record:
            del self._by_key[record.key]
        siblings = self._children.get(record.parent)
        if siblings is not None:
            siblings.remove(page)
            if not len(siblings):
                del self._children[record.parent]

    @staticmethod
    def _verified(record: PageRecord, parent: bytes, tokens: tuple[int, ...], media: tuple[MediaRun, ...]) -> bool:
        """A key match is trusted only if the stored parent, tokens and media match too."""
        return (record.parent, record.tokens, record.media) == (parent, tokens, media)

    def _best_tail_by_rows(self, siblings: TailSources, content: SeqContent, start: int, limit: int
                           ) -> tuple[int | None, int]:
        """The exact, row-by-row tail search (what `TailSources.best` computes from codes): the page with the
        most leading rows equal to `content` from `start`, the lowest page id among equals."""
        tail_page, tail_rows = None, 0
        for page in siblings.pages():
            rows = common_rows(self._by_page[page], content, start, limit)
            if rows > tail_rows:
                tail_page, tail_rows = page, rows
        return tail_page, tail_rows

    # -- lookup --------------------------------------------------------------------------------------
    def whole_pages(self, content: SeqContent, root: bytes, max_tokens: int) -> tuple[list[int], list[bytes]]:
        """The longest chain of recorded full pages that `content` starts with, within `max_tokens` tokens:
        (pages, their keys). Its end may fall inside an image (`lookup` snaps; deterministic mode does not)."""
        pages: list[int] = []
        keys: list[bytes] = []
        for parent, tokens, media, key in page_chain(content, root, self.page_size, max_tokens):
            record = self._by_key.get(key)
            if record is None or not self._verified(record, parent, tokens, media):
                break
            pages.append(record.page)
            keys.append(key)
        return pages, keys

    def lookup(self, content: SeqContent, root: bytes, max_tokens: int) -> PrefixHit:
        """Longest reusable prefix of `content` within its first `max_tokens` tokens."""
        size = self.page_size
        pages, keys = self.whole_pages(content, root, max_tokens)
        parent = keys[-1] if keys else root
        start = len(pages) * size
        tail_page, tail_rows = None, 0
        limit = min(size, max_tokens - start)
        siblings = self._children.get(parent)
        if limit > 0 and siblings is not None:
            query = row_codes(content.tokens[start : start + limit], content.media_runs(start, start + limit))
            tail_page, tail_rows = siblings.best(query)
            if tail_page is not None and common_rows(self._by_page[tail_page], content, start, limit) != tail_rows:
                tail_page, tail_rows = self._best_tail_by_rows(siblings, content, start, limit)  # a code collision

        hit = start + tail_rows
        span = content.span_containing(hit)
        if span is not None:
            hit = span.start  # a boundary inside an image: recompute the whole image
        full = hit // size
        rows = hit % size
        if rows and full < len(pages):
            tail_page = pages[full]  # the snapped boundary falls in a page we matched whole
        return PrefixHit(tuple(pages[:full]), tuple(keys[:full]), tail_page if rows else None, rows, size)
