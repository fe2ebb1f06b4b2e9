"""Physical pages of one KV pool: reference counts, the free list, lazy retention.

Owns *exact refcounts / no leaks* (invariant 6) at the pool level: a page is free exactly when its
refcount is 0, and every free page is on the free list once. Freed pages keep whatever prefix-index
records describe them (lazy retention): they can be revived by a hit until the allocator hands them out
again, oldest freed first, at which point `on_reuse` lets the cache policy forget them.

The pool knows nothing about tokens or keys: that is the prefix index's business (vLLM v1 style
separation of the block pool from the cache policy).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than the pool has free."""


class PageRefError(RuntimeError):
    """A reference count would go negative or a page id is out of range: always a bug upstream."""


class PagePool:
    """`num_pages` pages with refcounts and a FIFO free list (oldest freed page reused first)."""

    def __init__(self, num_pages: int, name: str = "gpu") -> None:
        if num_pages < 0:
            raise ValueError(f"a pool needs a non-negative page count, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        # Called with a page id when a free page is handed out again: its old contents stop existing.
        self.on_reuse: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def free_pages(self) -> list[int]:
        """Free pages, oldest freed first (the order `allocate` takes them in)."""
        return list(self._free)

    def is_free(self, page: int) -> bool:
        return page in self._free

    def allocate(self, n: int, exclude: Iterable[int] = ()) -> list[int]:
        """Take `n` free pages (oldest first, skipping `exclude`), each with refcount 1."""
        skip = set(exclude)
        if n > len(self._free) - len(skip & self._free.keys()):
            raise OutOfPages(f"{self.name} pool: asked for {n} pages, {len(self._free)} free")
        taken = []
        for page in self._free:
            if len(taken) == n:
                break
            if page not in skip:
                taken.append(page)
        for page in taken:
            del self._free[page]
            self.refcount[page] = 1
            if self.on_reuse is not None:
                self.on_reuse(page)
        return taken

    def incref(self, page: int) -> None:
        """Add a reference; a free page is revived (taken off the free list with its contents)."""
        self._check(page)
        if self.refcount[page] == 0:
            del self._free[page]
        self.refcount[page] += 1

    def decref(self, page: int) -> None:
        self._check(page)
        if self.refcount[page] <= 0:
            raise PageRefError(f"{self.name} page {page}: decref of a free page")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free[page] = None

    def _check(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise PageRefError(f"{self.name} page {page} out of range [0, {self.num_pages})")

    def check_consistent(self) -> None:
        """Free list == pages with refcount 0, each once; no negative counts."""
        zero = {p for p, c in enumerate(self.refcount) if c == 0}
        if any(c < 0 for c in self.refcount):
            raise AssertionError(f"{self.name}: negative refcount")
        if zero != set(self._free) or len(self._free) != len(zero):
            raise AssertionError(f"{self.name}: free list {sorted(self._free)} != refcount-0 pages {sorted(zero)}")
