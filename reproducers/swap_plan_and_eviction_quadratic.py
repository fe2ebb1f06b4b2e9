"""Found by review (session 27): building one transfer plan and evicting cache entries took time growing with the
square of their size. `TransferPlan.add` rechecked the whole plan for every move (3.7 s for the 2,048 page moves of
one 32k-token sequence swapped at 16-token pages), and `evict_until` rescanned every entry's pages for every
eviction (0.27 s to evict 400 entries of 20 pages, ~4 s for 1,600). Now each is linear: this builds a 4,096-move
plan and evicts 1,600 entries, apart or all sharing one page, and fails if either takes a second (fixed: ~10 ms and
~70 ms on the CPU machine)."""

from __future__ import annotations

import time

import _common  # noqa: F401 - makes `prism` importable

from prism.kv.pages import PagePool
from prism.kv.reclaim import CacheEntries
from prism.kv.transfers import Move, TransferPlan

LIMIT_S = 1.0

start = time.perf_counter()
plan = TransferPlan()
for page in range(4096):
    plan.add(Move("swap_out", ("gpu", page), ("cpu", page)))
plan_s = time.perf_counter() - start

pool = PagePool(1600 * 20)
cache = CacheEntries(pool)
for clock in range(1600):
    pages = pool.allocate(20)
    cache.add(pages[:-1], pages[-1], 20 * 16 - 3, clock)
    for page in pages:
        pool.decref(page)  # held by the cache entry alone
start = time.perf_counter()
cache.evict_until(pool.num_pages)
evict_s = time.perf_counter() - start

# The same under one page every entry shares (a common system prompt): re-keying every entry that shared a page
# with the evicted one was quadratic again (the first fix; found by review).
shared_pool = PagePool(1600 * 20 + 1)
shared_cache = CacheEntries(shared_pool)
common = shared_pool.allocate(1)[0]
for clock in range(1600):
    pages = shared_pool.allocate(19)
    shared_cache.add([common, *pages[:-1]], pages[-1], 20 * 16 - 3, clock)
    for page in pages:
        shared_pool.decref(page)
shared_pool.decref(common)
start = time.perf_counter()
shared_cache.evict_until(shared_pool.num_pages)
evict_s = max(evict_s, time.perf_counter() - start)

_common.verdict(
    plan_s < LIMIT_S and evict_s < LIMIT_S and pool.num_free == pool.num_pages
    and shared_pool.num_free == shared_pool.num_pages,
    f"a 4,096-move plan built in {plan_s * 1e3:.0f} ms, 1,600 entries evicted in {evict_s * 1e3:.0f} ms",
    f"a 4,096-move plan took {plan_s:.2f} s and evicting 1,600 entries {evict_s:.2f} s (limit {LIMIT_S} s each; "
    f"{pool.num_free} of {pool.num_pages} pages free): quadratic again?",
)
