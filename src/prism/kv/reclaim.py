"""Evictable cache entries, reclaimable capacity over unique pages, and the eviction order.

Owns *unique-page reclaim accounting* (invariant 3): reclaimable = the distinct physical pages all of
whose references come from evictable cache entries. A page held by two entries counts once; a page held
by a live request (or a pending transfer) never counts. `num_reclaimable` is exactly what evicting every
entry frees, which is what makes `can_allocate` exact. (The historical bug counted `refcount == 1` pages,
missing pages shared by two idle entries, and refused requests that eviction could have served.)

Eviction order: first the private tail pages of idle entries (a tail saves less than a page of prefill
but costs a whole page), oldest use first, then whole entries by lowest benefit per page they alone hold, oldest use
first (`eviction_key`). One `evict_until` costs O(pages the entries hold + evictions x log entries): an entry's key
changes only when an eviction leaves it alone on one of its pages, so only those are re-keyed (rescanning every entry
per eviction took 0.27 s to empty 400 entries of 20 pages, growing with the square of the entries).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from .pages import PagePool


@dataclass
class CacheEntry:
    """The computed prefix of a finished request, kept to serve later hits."""

    entry_id: int
    pages: list[int]  # full pages, in sequence order
    tail_page: int | None  # a partly filled last page (unkeyed), if any
    num_tokens: int
    last_used: int
    hits: int = 0

    def all_pages(self) -> list[int]:
        return self.pages + ([self.tail_page] if self.tail_page is not None else [])


@dataclass
class CacheEntries:
    pool: PagePool
    entries: dict[int, CacheEntry] = field(default_factory=dict)
    entry_refs: Counter = field(default_factory=Counter)  # page -> references held by entries
    _holders: dict[int, set[int]] = field(default_factory=dict)  # page -> entry ids
    _next_id: int = 0
    evictions: int = 0

    def add(self, pages: list[int], tail_page: int | None, num_tokens: int, clock: int) -> CacheEntry:
        """Keep `pages` (+ tail) alive as an entry: takes one reference on each."""
        entry = CacheEntry(self._next_id, list(pages), tail_page, num_tokens, clock)
        self._next_id += 1
        self.entries[entry.entry_id] = entry
        for page in entry.all_pages():
            self._ref(entry, page)
        return entry

    def touch(self, pages: Iterable[int], clock: int) -> None:
        """A hit used these pages: the entries holding them gain a hit and become most recently used."""
        seen: set[int] = set()
        for page in pages:
            seen |= self._holders.get(page, set())
        for entry_id in seen:
            entry = self.entries[entry_id]
            entry.hits += 1
            entry.last_used = clock

    def is_reclaimable(self, page: int) -> bool:
        refs = self.entry_refs.get(page, 0)
        return refs > 0 and self.pool.refcount[page] == refs

    def _held_by_one_entry_alone(self, page: int) -> bool:
        """One entry references `page` and nothing else does: evicting that entry frees it."""
        return self.entry_refs.get(page, 0) == 1 and self.pool.refcount[page] == 1

    def reclaimable_pages(self) -> set[int]:
        return {p for p in self.entry_refs if self.is_reclaimable(p)}

    def num_reclaimable(self) -> int:
        return sum(1 for p in self.entry_refs if self.is_reclaimable(p))

    def evict_until(self, num_free: int) -> None:
        """Evict in policy order until the pool has `num_free` free pages or nothing is left to evict.

        Whether a page is reclaimable never changes here: an entry letting a page go lowers its refcount and its
        entry references together. So the idle tails are the ones found first, in their order, and an entry's key
        changes only when an eviction leaves it alone on one of its pages."""
        if self.pool.num_free >= num_free:
            return
        idle_tails = sorted((e for e in self.entries.values()
                             if e.tail_page is not None and self.is_reclaimable(e.tail_page)),
                            key=lambda e: (e.last_used, e.entry_id))
        for entry in idle_tails:
            if self.pool.num_free >= num_free:
                return
            if entry.tail_page is not None:  # (a shared tail page may be gone with an entry removed before)
                self._drop_tail(entry)
        heap = [key for entry in self.entries.values() if (key := self.eviction_key(entry)) is not None]
        heapq.heapify(heap)
        while self.pool.num_free < num_free and heap:
            key = heapq.heappop(heap)
            entry = self.entries.get(key[-1])
            if entry is None or self.eviction_key(entry) != key:
                continue  # evicted, or re-keyed since: its current key is in the heap
            self._remove(entry)
            self.evictions += 1
            # An entry's key changes only when one of its pages becomes its alone: held now by that one entry and
            # nothing else (re-keying every entry that shared a page was quadratic again under a page all share).
            alone_now = {next(iter(self._holders[p])) for p in entry.all_pages() if self._held_by_one_entry_alone(p)}
            for entry_id in alone_now:
                if (fresh := self.eviction_key(self.entries[entry_id])) is not None:
                    heapq.heappush(heap, fresh)

    def eviction_key(self, entry: CacheEntry) -> tuple[float, int, int] | None:
        """(benefit per page it alone holds, last use, id): the entry with the lowest is evicted first. None: evicting
        it would free nothing (every page it holds is also held by a request or a transfer)."""
        pages = entry.all_pages()
        if not any(self.is_reclaimable(p) for p in pages):
            return None
        alone = sum(1 for p in pages if self._held_by_one_entry_alone(p))
        return (1 + entry.hits) * entry.num_tokens / max(alone, 1), entry.last_used, entry.entry_id

    def clear(self) -> None:
        for entry_id in list(self.entries):
            self._remove(self.entries[entry_id])

    def holds_only_as_tail(self, page: int) -> bool:
        """Every entry referencing `page` holds it as its partly filled tail (never as a keyed full page)."""
        return all(self.entries[e].tail_page == page for e in self._holders.get(page, ()))

    def give_up_tail(self, page: int) -> None:
        """The entries holding `page` as their tail let it go (their full pages stay cached): a sequence that then
        holds it alone writes past its cached rows in place instead of copying it (`KVCacheManager.reserve`)."""
        for entry_id in list(self._holders.get(page, ())):
            self._drop_tail(self.entries[entry_id])

    def _drop_tail(self, entry: CacheEntry) -> None:
        page = entry.tail_page
        assert page is not None
        entry.tail_page = None
        self._unref(entry, page)
        if not entry.pages:
            self._remove(entry)

    def _remove(self, entry: CacheEntry) -> None:
        del self.entries[entry.entry_id]
        for page in entry.all_pages():
            self._unref(entry, page)

    def _ref(self, entry: CacheEntry, page: int) -> None:
        self.pool.incref(page)
        self.entry_refs[page] += 1
        self._holders.setdefault(page, set()).add(entry.entry_id)

    def _unref(self, entry: CacheEntry, page: int) -> None:
        self.entry_refs[page] -= 1
        if self.entry_refs[page] == 0:
            del self.entry_refs[page]
        holders = self._holders[page]
        holders.discard(entry.entry_id)
        if not holders:
            del self._holders[page]
        self.pool.decref(page)
