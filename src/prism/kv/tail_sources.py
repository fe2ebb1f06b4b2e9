"""The tail-source search of the prefix index: which child of a page chain shares the most leading rows with a
query, in one vectorized pass whatever the number of children.

Why: every request about the same images leaves one more page under the images' last full page (its question's
tail), and each lookup looks for the best tail among all of them. Compared row by row in Python, the lookup grew
with every question asked (W2 after 35 questions: ~50 siblings, most of a lookup's ~1 ms; thousands of questions
would cost tens of milliseconds per request). Here the children of one parent are rows of a matrix of row codes,
and the longest common prefix with every child is one NumPy comparison.

A row code is the token id for a text row and a 63-bit negative code of (token, media digest, offset in the
item) for a media row: equal rows always get equal codes, so the search never misses a tail the row-by-row
comparison would find. Different media rows could share a code (a 39-bit hash): the prefix index verifies the
chosen tail with the exact comparison and falls back to it on a mismatch, so a collision costs time, never a
wrong hit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from .content import MediaRun

_OFFSET_BITS = 23
_BASE_BITS = 39
_GOLDEN = 0x9E3779B1


def _media_base(digest: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(digest, digest_size=5).digest(), "little")  # 40 bits, masked below


def row_codes(tokens: Sequence[int], media: tuple[MediaRun, ...], first: int = 0) -> np.ndarray:
    """int64 code of rows [first, len(tokens)) of a page (or page prefix) holding `tokens`, with `media` runs at
    their rows."""
    codes = np.fromiter(tokens[first:], dtype=np.int64, count=len(tokens) - first)
    for run in media:
        lo, hi = max(run.row, first), min(run.row + run.length, len(tokens))
        if lo >= hi:
            continue
        offset = run.offset + lo - run.row
        if offset + (hi - lo) >= 1 << _OFFSET_BITS:
            raise ValueError(f"a media item of more than {1 << _OFFSET_BITS} tokens")
        rows = slice(lo - first, hi - first)
        mixed = (_media_base(run.digest) ^ (codes[rows] * _GOLDEN)) & ((1 << _BASE_BITS) - 1)
        codes[rows] = -1 - ((mixed << _OFFSET_BITS) | (offset + np.arange(hi - lo, dtype=np.int64)))
    return codes


class TailSources:
    """The pages recorded under one parent key, as rows of a code matrix (a page's row: its records' codes)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        # One matrix row to start (most parents have one child), doubled when full: 8 bytes per recorded token.
        self._codes = np.zeros((1, page_size), dtype=np.int64)
        self._lengths = np.zeros(1, dtype=np.int64)  # rows of each matrix row that hold codes (0: free)
        self._pages = np.full(1, -1, dtype=np.int64)
        self._row_of: dict[int, int] = {}
        self._free = [0]

    def __len__(self) -> int:
        return len(self._row_of)

    def pages(self) -> list[int]:
        return sorted(self._row_of)

    def put(self, page: int, tokens: Sequence[int], media: tuple[MediaRun, ...], known_rows: int = 0) -> None:
        """Record `page` holding `tokens` (with `media`). `known_rows`: leading rows already recorded for this page
        and unchanged (a partial page that grew): only the rows after them are coded."""
        row = self._row_of.get(page)
        if row is None:
            row, known_rows = self._allocate(page), 0
        if known_rows < len(tokens):
            self._codes[row, known_rows : len(tokens)] = row_codes(tokens, media, first=known_rows)
        self._lengths[row] = len(tokens)

    def remove(self, page: int) -> None:
        row = self._row_of.pop(page)
        self._pages[row] = -1
        self._lengths[row] = 0
        self._free.append(row)

    def best(self, query: np.ndarray) -> tuple[int | None, int]:
        """(page, rows): the recorded page whose leading rows match the most leading rows of `query` (codes of at
        most page_size rows), the lowest page id among equals; (None, 0) if none matches a row."""
        n = len(query)
        if n == 0 or not self._row_of:
            return None, 0
        differs = self._codes[:, :n] != query
        first = np.where(differs.any(axis=1), differs.argmax(axis=1), n)
        rows = np.minimum(first, self._lengths)  # free rows have length 0
        most = int(rows.max())
        if most == 0:
            return None, 0
        return int(self._pages[rows == most].min()), most

    def _allocate(self, page: int) -> int:
        if not self._free:
            size = len(self._pages)
            self._codes = np.concatenate([self._codes, np.zeros_like(self._codes)])
            self._lengths = np.concatenate([self._lengths, np.zeros(size, dtype=np.int64)])
            self._pages = np.concatenate([self._pages, np.full(size, -1, dtype=np.int64)])
            self._free = list(range(2 * size - 1, size - 1, -1))
        row = self._free.pop()
        self._row_of[page] = row
        self._pages[row] = page
        return row
