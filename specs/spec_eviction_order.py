"""Spec of the eviction order (REFERENCE §2, invariant 3's policy half), on the real `CacheEntries`.

Random cache entries over a small pool (pages shared between entries, tails shared or private, hits, uses), some
pages also held by requests; then `evict_until` a random number of free pages. Each step it takes must be the
policy's choice at that moment, recomputed from scratch over every entry left:
- first the idle tails (tail pages only entries hold), oldest use first;
- then whole entries, each the one with the lowest `eviction_key` among the entries left (benefit per page it
  alone holds, then oldest use, then id), and never an entry whose eviction frees nothing;
- it stops once the pool has the pages asked for, or when nothing evictable is left (and only then).
`evict_until` re-keys only the entries sharing a page with the one it evicted (rescanning all of them per eviction
was quadratic): the spec is what says that re-keying is enough.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from prism.kv.pages import PagePool
from prism.kv.reclaim import CacheEntries, CacheEntry

NUM_PAGES = 12

ENTRY = st.tuples(
    st.lists(st.integers(0, NUM_PAGES - 1), min_size=0, max_size=4, unique=True),  # full pages
    st.one_of(st.none(), st.integers(0, NUM_PAGES - 1)),  # tail page
    st.integers(1, 64),  # tokens
    st.integers(0, 5),  # last used
    st.integers(0, 3),  # hits
)


class RecordingEntries(CacheEntries):
    """The real CacheEntries; while `evicting`, each step `evict_until` takes is checked against the policy
    recomputed from scratch over the entries left, and recorded."""

    evicting = False
    in_tail_drop = False

    def __init__(self, pool: PagePool) -> None:
        super().__init__(pool)
        self.steps: list[tuple[str, int]] = []

    def idle_tails(self) -> list[CacheEntry]:
        return [e for e in self.entries.values() if e.tail_page is not None and self.is_reclaimable(e.tail_page)]

    def _drop_tail(self, entry: CacheEntry) -> None:
        if self.evicting:
            oldest = min(self.idle_tails(), key=lambda e: (e.last_used, e.entry_id))
            assert entry is oldest, f"tail of entry {entry.entry_id} dropped before the older idle tail of " \
                                    f"entry {oldest.entry_id}"
            self.steps.append(("tail", entry.entry_id))
        self.in_tail_drop = True
        try:
            super()._drop_tail(entry)
        finally:
            self.in_tail_drop = False

    def _remove(self, entry: CacheEntry) -> None:
        if self.evicting and not self.in_tail_drop:
            assert not self.idle_tails(), f"entry {entry.entry_id} evicted while idle tails are left"
            keys = [k for e in self.entries.values() if (k := self.eviction_key(e)) is not None]
            chosen = self.eviction_key(entry)
            assert chosen is not None, f"entry {entry.entry_id} evicted though evicting it frees nothing"
            assert chosen == min(keys), f"evicted entry {entry.entry_id} with key {chosen}; the policy's choice " \
                                        f"is {min(keys)}"
            self.steps.append(("entry", entry.entry_id))
        super()._remove(entry)


def build(entries, request_pages) -> tuple[PagePool, RecordingEntries]:
    pool = PagePool(NUM_PAGES)
    cache = RecordingEntries(pool)
    for clock, (pages, tail, tokens, last_used, hits) in enumerate(entries):
        entry = cache.add(pages, None if tail in pages else tail, tokens, last_used * 10 + clock % 10)
        entry.hits = hits
    for page in request_pages:
        pool.incref(page)  # a request (or a transfer) holds it too
    return pool, cache


@settings(max_examples=400, deadline=None)
@given(entries=st.lists(ENTRY, min_size=1, max_size=7),
       request_pages=st.lists(st.integers(0, NUM_PAGES - 1), max_size=4, unique=True),
       more=st.integers(1, NUM_PAGES))
def spec_eviction_takes_the_policys_choice_at_every_step(entries, request_pages, more) -> None:
    pool, cache = build(entries, request_pages)
    wanted = pool.num_free + more
    shared = {e.entry_id for e in cache.entries.values()
              if any(len(cache._holders[p]) > 1 for p in e.all_pages())}
    evictions = cache.evictions
    cache.evicting = True
    cache.evict_until(wanted)
    cache.evicting = False
    entries_evicted = sum(1 for kind, _ in cache.steps if kind == "entry")
    assert cache.evictions - evictions == entries_evicted, "an entry eviction not counted, or counted twice"
    if pool.num_free < wanted:
        assert not cache.idle_tails(), f"stopped at {pool.num_free} free pages of {wanted} with idle tails left"
        left = [e.entry_id for e in cache.entries.values() if cache.eviction_key(e) is not None]
        assert not left, f"stopped at {pool.num_free} free pages of {wanted} with evictable entries {left} left"
    event(f"{min(entries_evicted, 3)}{'+' if entries_evicted >= 3 else ''} entries evicted")
    if any(kind == "entry" and entry_id in shared for kind, entry_id in cache.steps):
        event("an evicted entry shared a page")
    event("tails dropped" if any(kind == "tail" for kind, _ in cache.steps) else "no tail dropped")
    pool.check_consistent()
