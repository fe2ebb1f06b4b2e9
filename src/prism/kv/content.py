"""What a sequence's KV depends on: its token ids and the media items at their positions.

Owns the *prefix identity* inputs (invariant 7): the KV at position i is a function of every token id,
every media content digest and every media position in [0, i]. Two sequences may share the KV of a
page only if this content is identical up to the end of that page.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import NamedTuple


class ContentError(ValueError):
    """A sequence's content is malformed (overlapping media, spans out of range, empty digest...)."""


@dataclass(frozen=True)
class MediaSpan:
    """One image or video occupying tokens [start, start + length) of a sequence.

    `digest` identifies the decoded pixels *and* the processor layout (grid, resize settings): the
    media layer computes it; the KV core only compares it.
    """

    start: int
    length: int
    digest: bytes

    @property
    def end(self) -> int:
        return self.start + self.length


class MediaRun(NamedTuple):
    """The part of one media item that falls inside a page: rows [row, row + length) of the page hold
    tokens [offset, offset + length) of the item with this digest. A named tuple, not a dataclass: a lookup
    makes and compares one per page and image (a frozen dataclass cost ~1 us to make, its `==` more)."""

    row: int
    length: int
    digest: bytes
    offset: int


@dataclass
class SeqContent:
    """Token ids (growing during decode) plus the media spans of the prompt."""

    tokens: list[int]
    media: tuple[MediaSpan, ...] = field(default_factory=tuple)
    # The last media_runs answer, keyed by its range clipped to the media (every decode step of a sequence asks
    # for its partial page's runs; they stop changing once the page's range passes the last span).
    _last_runs: tuple[tuple[int, int], tuple[MediaRun, ...]] | None = field(
        default=None, init=False, repr=False, compare=False)
    _span_ends: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.media = tuple(sorted(self.media, key=lambda m: m.start))
        previous_end = 0
        for span in self.media:
            if span.length <= 0 or span.start < 0:
                raise ContentError(f"media span {span.start}+{span.length} is empty or negative")
            if span.start < previous_end:
                raise ContentError(f"media spans overlap at token {span.start}")
            if span.end > len(self.tokens):
                raise ContentError(f"media span ends at {span.end}, past the {len(self.tokens)} prompt tokens")
            if len(span.digest) < 16:
                raise ContentError("a media digest must have at least 128 bits")
            previous_end = span.end
        self._span_ends = [span.end for span in self.media]  # sorted too: spans are sorted and disjoint

    def __len__(self) -> int:
        return len(self.tokens)

    def media_runs(self, start: int, end: int) -> tuple[MediaRun, ...]:
        """The media inside positions [start, end), as runs with rows relative to `start`."""
        if not self.media or start >= self.media[-1].end:  # decode positions: past every span (sorted, disjoint)
            return ()
        key = (start, min(end, self.media[-1].end))
        if self._last_runs is not None and self._last_runs[0] == key:
            return self._last_runs[1]
        runs: list[MediaRun] = []
        # From the first span ending after `start`, while spans begin before `end`: each page visits the spans
        # it overlaps, not every span of the prompt (a lookup over many images' pages was quadratic).
        for i in range(bisect_right(self._span_ends, start), len(self.media)):
            span = self.media[i]
            if span.start >= end:
                break
            lo, hi = max(start, span.start), min(end, span.end)
            if lo < hi:
                runs.append(MediaRun(lo - start, hi - lo, span.digest, lo - span.start))
        self._last_runs = (key, tuple(runs))
        return self._last_runs[1]

    def span_containing(self, position: int) -> MediaSpan | None:
        """The media span with start < position < end (a boundary strictly inside it), if any."""
        if not self.media or position >= self.media[-1].end:
            return None
        span = self.media[bisect_right(self._span_ends, position)]  # the first span ending after `position`
        return span if span.start < position else None
