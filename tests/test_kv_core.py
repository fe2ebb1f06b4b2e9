"""Unit tests of the KV core: pool policy (FIFO reuse, lazy retention), eviction order, hit rules and
every bad input's typed error. The invariants themselves are specified in specs/."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.kv.content import ContentError, MediaSpan, SeqContent
from prism.kv.manager import PENDING_TOKEN, KVCacheManager, SequenceError
from prism.kv.pages import OutOfPages, PagePool, PageRefError
from prism.kv.transfers import Move, PlanConflict, TransferPlan
from prism.testing.kv_world import KVWorld


def test_pool_reuses_oldest_freed_page_first_and_revives_retained_pages() -> None:
    pool = PagePool(3)
    reused: list[int] = []
    pool.on_reuse = reused.append
    a, b, c = pool.allocate(3)
    pool.decref(b)
    pool.decref(a)
    pool.incref(a)  # revived: off the free list, contents intact, no reuse callback
    assert pool.free_pages() == [b] and reused == [a, b, c]
    pool.decref(a)
    assert pool.free_pages() == [b, a]
    assert pool.allocate(1) == [b]  # oldest freed first
    assert reused[-1] == b


def test_pool_errors() -> None:
    pool = PagePool(2)
    with pytest.raises(OutOfPages, match="asked for 3 pages"):
        pool.allocate(3)
    with pytest.raises(PageRefError, match="decref of a free page"):
        pool.decref(0)
    with pytest.raises(PageRefError, match="out of range"):
        pool.incref(7)
    with pytest.raises(ValueError, match="non-negative"):
        PagePool(-1)


def test_content_errors() -> None:
    digest = b"\x01" * 16
    with pytest.raises(ContentError, match="overlap"):
        SeqContent([9] * 6, (MediaSpan(0, 4, digest), MediaSpan(2, 2, digest)))
    with pytest.raises(ContentError, match="past the 3 prompt tokens"):
        SeqContent([9] * 3, (MediaSpan(1, 4, digest),))
    with pytest.raises(ContentError, match="128 bits"):
        SeqContent([9] * 3, (MediaSpan(0, 2, b"short"),))
    with pytest.raises(ContentError, match="empty"):
        SeqContent([9] * 3, (MediaSpan(0, 0, digest),))


def test_manager_errors_change_nothing() -> None:
    m = KVCacheManager(num_gpu_pages=2, page_size=4)
    with pytest.raises(SequenceError, match="empty"):
        m.admit(1, SeqContent([]), 1)
    with pytest.raises(OutOfPages, match="needs 3 new pages"):
        m.admit(1, SeqContent(list(range(1, 12))), 11)
    assert m.gpu.num_free == 2 and not m.seqs
    m.admit(1, SeqContent([1, 2, 3]), 3)
    with pytest.raises(SequenceError, match="already admitted"):
        m.admit(1, SeqContent([1]), 1)
    with pytest.raises(SequenceError, match="publish"):
        m.publish_computed(1, 1, 2)  # not starting at num_computed
    with pytest.raises(SequenceError, match="reserving past"):
        m.reserve(1, 9)
    with pytest.raises(SequenceError, match="unknown sequence 5"):
        m.release(5)
    m.check_invariants()


def test_pending_tokens_with_a_chunk_are_reserved_all_or_nothing() -> None:
    """Async scheduling: decode rows' pending slots and a prefill chunk beside them get their pages together, or
    nothing changes (the engine then schedules the step, which may preempt)."""
    m = KVCacheManager(num_gpu_pages=4, page_size=4)
    m.admit(1, SeqContent([1, 2, 3, 4]), 4)
    m.publish_computed(1, 0, 4)
    m.append_tokens(1, [5])
    m.reserve(1, 1)
    m.publish_computed(1, 4, 5)  # decoding: 5 tokens computed, two pages
    m.admit(2, SeqContent(list(range(10, 20))), 4)  # a 10-token prompt, its first chunk of 4 scheduled
    m.publish_computed(2, 0, 4)
    free = m.gpu.num_free
    assert free == 1
    # The chunk [4, 10) needs two more pages, the pending slot none: one page is free, so nothing happens.
    assert not m.reserve_pending([1], chunk=(2, 6))
    assert m.gpu.num_free == free and m.seqs[1].content.tokens[-1] == 5 and len(m.seqs[2].pages) == 1
    assert not m.reserve_pending([1], chunk=(1, 1)), "a decode row is not its own chunk"
    assert not m.reserve_pending([1], chunk=(2, 7)), "a chunk past the sequence's known tokens"
    assert m.reserve_pending([1], chunk=(2, 4))
    assert m.seqs[1].content.tokens[-1] == PENDING_TOKEN and len(m.seqs[2].pages) == 2 and m.gpu.num_free == 0
    m.publish_computed(2, 4, 8)
    m.fill_pending(1, 6)
    m.publish_computed(1, 5, 6)
    m.check_invariants()


def test_full_hit_leaves_one_token_and_decode_after_page_aligned_hit() -> None:
    world = KVWorld(num_gpu_pages=8, page_size=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    world.admit(1, SeqContent(list(prompt)), 8)
    world.step()
    world.release(1)
    hit = world.admit(2, SeqContent(list(prompt)), 8)
    assert hit == 7, "a full hit must still compute the last prompt token"
    world.step()
    for token in (3, 1, 2, 2, 1):  # decode across a page boundary after the hit
        world.decode(2, token)
        world.step()
    world.check_all()


def test_hit_inside_an_image_snaps_to_the_image_start() -> None:
    world = KVWorld(num_gpu_pages=16, page_size=4)
    image = MediaSpan(2, 8, b"\x07" * 16)
    tokens = [1, 2] + [9] * 8 + [3, 4]
    world.admit(1, SeqContent(list(tokens), (image,)), 12)
    world.step()
    world.release(1)
    # Evict the page holding the image's tail: a plain lookup would end inside the image.
    entry = next(iter(world.manager.entries.entries.values()))
    for page in entry.pages[2:]:
        world.manager.index.forget_page(page)
    hit = world.admit(2, SeqContent(list(tokens), (image,)), 12)
    assert hit == 2, f"hit {hit} must snap down to the image start (2)"
    world.step()
    world.check_all()


def test_a_hit_looked_up_before_the_index_changed_is_looked_up_again() -> None:
    """The scheduler hands `admit` the hit it just looked up; a hit found before any change of the index (here a
    page of it forgotten, as when the pool reuses it) is never attached: admit looks up again."""
    world = KVWorld(num_gpu_pages=16, page_size=4)
    tokens = list(range(1, 13))
    world.admit(1, SeqContent(list(tokens)), 12)
    world.step()
    world.release(1)
    manager = world.manager
    content = SeqContent(list(tokens))
    fresh = manager.lookup(content)
    assert manager.admission_cost(content, 4, hit=fresh)[0] is fresh  # unchanged index: reused as it is
    assert manager.admission_cost(content, 4, "whole_pages", hit=fresh)[0] is not fresh  # found for another query
    stale = manager.lookup(content)
    forgotten = stale.shared_pages[1]
    manager.index.forget_page(forgotten)
    seq = manager.admit(2, content, 4, hit=stale)
    assert forgotten not in [page for _, page in seq.pages], "a page of a stale hit was attached"
    assert seq.num_computed == 4 < stale.num_tokens
    world.step()
    world.check_all()


def test_eviction_drops_idle_private_tails_first_then_lowest_benefit() -> None:
    world = KVWorld(num_gpu_pages=10, page_size=4)
    world.admit(1, SeqContent([1, 2, 3, 4, 5, 6]), 6)  # one full page + a 2-row tail
    world.admit(2, SeqContent([7, 7, 7, 7, 8, 8, 8, 8]), 8)  # two full pages, no tail
    world.step()
    world.release(1)
    world.release(2)
    entries = world.manager.entries
    first, second = sorted(entries.entries.values(), key=lambda e: e.entry_id)
    assert first.tail_page is not None
    world.manager.evict(1)
    assert first.tail_page is None and first.entry_id in entries.entries, "the idle tail goes first"
    # Now benefit per page: entry 1 covers 6 tokens on 1 page left, entry 2 covers 8 tokens on 2 pages.
    world.manager.evict(1)
    assert second.entry_id not in entries.entries and first.entry_id in entries.entries
    world.check_all()


def test_a_fork_takes_over_a_tail_only_cache_entries_share_when_a_copy_does_not_fit() -> None:
    """A full pool: the forked child writes the parent's partly filled tail page in place (its cache entry gives the
    tail up, keeping its full page) instead of copying it, which would need a page the pool does not have. While a
    live sibling still holds the tail it is copied, or refused when the copy does not fit."""
    world = KVWorld(num_gpu_pages=4, page_size=4)
    world.admit(1, SeqContent([1, 2, 3, 4, 5, 6]), 6)  # one full page + a 2-row tail
    world.step()
    m = world.manager
    m.fork(1, 2)
    m.fork(1, 3)
    world.release(1)  # the material: its pages become a cache entry (full page + tail)
    (entry,) = m.entries.entries.values()
    tail = entry.tail_page
    assert tail is not None
    m.append_tokens(2, [7] * 10)  # 16 tokens: the whole pool
    with pytest.raises(OutOfPages):
        m.reserve(2, 10)  # sibling 3 still holds the tail: a copy is needed, and it does not fit
    world.release(3, keep_in_cache=False)
    world.schedule(2, 10)
    assert m.seqs[2].pages[1] == ("gpu", tail) and m.stats.tail_takeovers == 1
    assert entry.tail_page is None and entry.pages == [m.seqs[2].pages[0][1]], "the entry keeps its full page"
    world.step()  # the KV bytes: every computed position holds its own content's KV
    world.check_all()


def test_plan_refuses_reads_after_writes() -> None:
    plan = TransferPlan()
    plan.add(Move("copy_on_write", ("gpu", 1), ("gpu", 2)))
    with pytest.raises(PlanConflict, match="writes"):
        plan.add(Move("copy_prefix", ("gpu", 3), ("gpu", 1), 2))  # copy-prefix runs before CoW reads page 1
    with pytest.raises(PlanConflict, match="already written"):
        plan.add(Move("swap_in", ("cpu", 0), ("gpu", 2)))
    plan.add(Move("swap_out", ("gpu", 2), ("cpu", 1)))  # swap-out reads before CoW writes: allowed
    assert [m.kind for m in plan.moves()] == ["swap_out", "copy_on_write"]


def test_fork_and_swap_refuse_sequences_with_pending_writes() -> None:
    world = KVWorld(num_gpu_pages=8, page_size=4, num_cpu_pages=4)
    world.admit(1, SeqContent([1, 2, 3, 4, 5, 6]), 6)
    world.step()
    world.release(1)
    world.admit(2, SeqContent([1, 2, 3, 4, 5, 9]), 6)  # tail copy pending into sequence 2's page
    with pytest.raises(PlanConflict):
        world.manager.fork(2, 3)
    with pytest.raises(PlanConflict):
        world.manager.swap_out(2)
    world.step()
    world.manager.fork(2, 3)
    world.check_all()


def test_a_partial_page_republished_with_other_rows_is_searched_by_its_new_rows():
    """The tail search codes only the new rows of a page that grew; a page whose recorded rows changed (not a
    growth) is recoded whole (found in review: the growth path trusted the old rows)."""
    from prism.kv.prefix import PrefixIndex

    index, root = PrefixIndex(4), b"r" * 16
    index.publish_partial(7, root, (1,), ())
    index.publish_partial(7, root, (2, 3), ())  # not (1, ...): other rows, the same page
    hit = index.lookup(SeqContent([2, 3, 9, 9], ()), root, 3)
    assert (hit.tail_source, hit.tail_rows) == (7, 2)
    assert index.lookup(SeqContent([1, 5, 9, 9], ()), root, 3).tail_rows == 0


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_media_runs_and_span_containing_equal_the_scan_over_every_span(data):
    """`media_runs` visits only the spans a range overlaps (a bisect over the sorted ends): the same runs as
    scanning every span, for any spans and range; `span_containing` likewise."""
    from prism.kv.content import MediaRun

    gaps = data.draw(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9)), max_size=6))
    spans, pos = [], 0
    for i, (gap, length) in enumerate(gaps):
        spans.append(MediaSpan(pos + gap, length, bytes([i]) * 16))
        pos += gap + length
    given_order = data.draw(st.permutations(spans))  # SeqContent sorts them
    content = SeqContent(list(range(pos + 3)), tuple(given_order))
    start = data.draw(st.integers(0, pos + 3))
    end = data.draw(st.integers(start - 3, pos + 6))
    scan = tuple(MediaRun(max(start, s.start) - start, min(end, s.end) - max(start, s.start), s.digest,
                          max(start, s.start) - s.start)
                 for s in spans if max(start, s.start) < min(end, s.end))
    assert content.media_runs(start, end) == scan
    inside = next((s for s in spans if s.start < start < s.end), None)
    assert content.span_containing(start) == inside


@pytest.mark.parametrize("threshold", [0, 2, 3])
def test_a_short_tail_after_pages_ending_inside_an_image_is_copied(threshold) -> None:
    """Dropping the 1-row tail would end the hit inside the image, which walks it back to 0 tokens: the tail is
    copied whatever the threshold (the tail-copy threshold may only cost the tail's own rows)."""
    world = KVWorld(num_gpu_pages=8, page_size=4, min_tail_tokens=threshold)
    image = (MediaSpan(1, 4, b"\xa1" * 16),)
    world.admit(1, SeqContent([1, 9, 9, 9, 9, 2, 3, 1], image), chunk=8)
    world.step()
    world.release(1)
    hit = world.manager.lookup(SeqContent([1, 9, 9, 9, 9, 3, 3], image))
    assert hit.num_tokens == 5 and hit.tail_rows == 1 and hit.tail_source is not None
    world.check_all()


@pytest.mark.parametrize("threshold, reused", [(0, 8 + 3), (3, 8 + 3), (4, 8)])
def test_a_tail_below_the_threshold_is_not_copied(threshold, reused) -> None:
    """A cached partial page is reused (rows copied into a private page) only if it saves `min_tail_tokens`
    tokens; below that the hit stops at the last whole page."""
    world = KVWorld(num_gpu_pages=8, page_size=8, min_tail_tokens=threshold)
    world.admit(1, SeqContent(list(range(1, 12)) + [90, 91]), chunk=13)  # two pages; tokens 1-11 then 90, 91
    world.step()
    world.release(1)
    hit = world.manager.lookup(SeqContent(list(range(1, 12)) + [70, 71, 72]))  # shares 11 tokens: a page + 3 rows
    assert hit.num_tokens == reused and (hit.tail_source is not None) == (reused % 8 != 0)
    world.check_all()
