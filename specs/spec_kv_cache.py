"""Stateful spec of the KV core (REFERENCE §2, invariants 1-3, 5-8): the real KVCacheManager over real
scaled-FP8 pool tensors, driven through random interleavings of admit, chunk, step, decode, fork,
cancel, finish, evict and swap, after a fixed tour of every rule (`tour`: the states the planted bugs of
`spec_planted_bugs_kv.py` need, reached whatever examples Hypothesis draws). After every rule the manager's own
accounting is checked; after every step, the KV bytes themselves (see prism.testing.kv_world: each slot's bytes
fingerprint its content).

Invariants checked, by name:
- publish after compute: findable rows hold their content's KV (check_findable_kv)
- tail without old key: keyed records are full pages whose key is recomputed from their content;
  copy_prefix leaves the rows past the common prefix untouched (snapshot check in KVWorld.step)
- unique-page reclaim: num_allocatable == pages freed by really evicting everything (on a deep copy)
- transfer order: every executed plan equals its snapshot meaning (KVWorld.step)
- exact refcounts / no leaks: check_invariants after every rule; teardown frees every page
- prefix identity + hit correctness: every computed position of every live sequence holds its own KV
- >= 1 computed token: every hit leaves the last prompt token to compute and never ends inside an image
- tail-copy threshold: a tail below `min_tail_tokens` is dropped only where that loses just its rows (the whole
  pages before it end outside images); the hit is never shorter than without the threshold by more than that
"""

from __future__ import annotations

import copy

from hypothesis import currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from prism.kv.keys import page_key
from prism.kv.pages import OutOfPages
from prism.kv.transfers import PlanConflict
from prism.testing.kv_world import KVWorld
from specs.kv_strategies import DIGESTS, IMAGE_PAD, build, contents
from specs.tours import Chosen


def _event(value: str) -> None:
    """`hypothesis.event` in the machine's examples (the tour runs outside a test)."""
    if currently_in_test_context():
        event(value)


class KVCacheMachine(RuleBasedStateMachine):
    page_aligned_hits = False  # deterministic mode's whole-page hits (`DeterministicKVCacheMachine`)

    def __init__(self) -> None:
        super().__init__()
        self.world: KVWorld | None = None
        self.history: list[list] = []
        self.next_id = 0

    @initialize(
        page_size=st.integers(1, 4),
        num_gpu_pages=st.integers(3, 12),
        num_cpu_pages=st.integers(0, 4),
        min_tail_tokens=st.sampled_from([0, 0, 2, 3]),
    )
    def setup(self, page_size: int, num_gpu_pages: int, num_cpu_pages: int, min_tail_tokens: int) -> None:
        self.world = KVWorld(num_gpu_pages=num_gpu_pages, page_size=page_size, num_cpu_pages=num_cpu_pages,
                             min_tail_tokens=min_tail_tokens, page_aligned_hits=self.page_aligned_hits)

    # -- helpers ---------------------------------------------------------------------------------
    @property
    def m(self):
        assert self.world is not None
        return self.world.manager

    # Which sequences a rule may pick (used both as the rule's precondition and for the draw).
    def _idle(self, seq) -> bool:
        return seq.seq_id not in self.world.pending

    def _idle_resident(self, seq) -> bool:
        return seq.is_resident and self._idle(seq)

    def _prefilling(self, seq) -> bool:
        return self._idle_resident(seq) and seq.num_computed < len(seq.content)

    def _decoding(self, seq) -> bool:
        return self._idle_resident(seq) and seq.num_computed == len(seq.content)

    def _swapped(self, seq) -> bool:
        return not seq.is_resident

    def _any(self, condition) -> bool:
        return self.world is not None and any(condition(seq) for seq in self.m.seqs.values())

    def _pick(self, data: st.DataObject, condition) -> int:
        """A sequence satisfying `condition` (the rule's precondition guarantees one exists)."""
        return data.draw(st.sampled_from(sorted(s for s, seq in self.m.seqs.items() if condition(seq))))

    def _try_admit(self, content, chunk: int) -> int | None:
        """Admit with a random chunk; None if the pool cannot take it (which must change nothing)."""
        seq_id, self.next_id = self.next_id, self.next_id + 1
        unthresholded = self._hit_without_copy_threshold(content)
        try:
            hit = self.world.admit(seq_id, content, chunk)
        except OutOfPages:
            assert seq_id not in self.m.seqs
            return None
        assert hit <= len(content) - 1, "a full hit must leave at least one token to compute"
        if self.m.page_aligned_hits:
            assert hit % self.m.page_size == 0, "a deterministic-mode hit must end at a page boundary"
            assert hit == self._whole_pages_found(content), "a deterministic-mode hit must take every whole page found"
            return hit
        assert content.span_containing(hit) is None, "a hit must not end inside an image"
        size, threshold = self.m.page_size, self.m.min_tail_tokens
        rows = hit % size
        assert not 0 < rows < threshold or content.span_containing(hit - rows) is not None, \
            f"a tail of {rows} tokens reused below min_tail_tokens={threshold} where whole pages end outside images"
        lost = unthresholded - hit
        assert lost == 0 or (rows == 0 and lost < threshold), \
            f"the tail-copy threshold dropped {lost} tokens of hit (min_tail_tokens={threshold})"
        return hit

    def _whole_pages_found(self, content) -> int:
        """Tokens of the recorded whole pages `content` starts with (recomputed by key, independently of lookup)."""
        parent, found, size = self.m.root, 0, self.m.page_size
        while found + size <= len(content) - 1:
            tokens = content.tokens[found : found + size]
            key = page_key(parent, tuple(tokens), content.media_runs(found, found + size))
            if key not in self.m.index._by_key:
                break
            parent, found = key, found + size
        return found

    def _hit_without_copy_threshold(self, content) -> int:
        """What the lookup reuses when every partial page is worth its copy (min_tail_tokens 0)."""
        keep, self.m.min_tail_tokens = self.m.min_tail_tokens, 0
        try:
            return self.m.lookup(content).num_tokens
        finally:
            self.m.min_tail_tokens = keep

    # -- rules -----------------------------------------------------------------------------------
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def admit(self, data: st.DataObject, chunk: int) -> None:
        self.admit_parts(data.draw(contents(self.history)), chunk)

    def admit_parts(self, parts: list, chunk: int) -> None:
        hit = self._try_admit(build(parts), chunk)
        if hit is not None:
            self.history.append(parts)
            _event("admit: " + ("no hit" if hit == 0 else "hit ends mid-page" if hit % self.m.page_size else "page-aligned hit"))

    @precondition(lambda self: self.world is not None and self.history)
    @rule(data=st.data(), chunk=st.integers(1, 12), question=st.lists(st.integers(1, 3), min_size=1, max_size=6))
    def admit_new_question(self, data: st.DataObject, chunk: int, question: list[int]) -> None:
        """The workload Prism exists for: an earlier prompt's images (and maybe text) + a new question."""
        base = data.draw(st.sampled_from(self.history))
        parts = list(base[: data.draw(st.integers(1, len(base)))]) + [(question, None)]
        hit = self._try_admit(build(parts), chunk)
        if hit is not None:
            _event("new question: " + ("no hit" if hit == 0 else "hit"))

    @precondition(lambda self: self._any(self._prefilling))
    @rule(data=st.data(), n=st.integers(1, 8))
    def schedule_chunk(self, data: st.DataObject, n: int) -> None:
        try:
            self.world.schedule(self._pick(data, self._prefilling), n)
        except (OutOfPages, PlanConflict):
            pass

    @precondition(lambda self: self._any(self._decoding))
    @rule(data=st.data(), token=st.integers(1, 3))
    def decode(self, data: st.DataObject, token: int) -> None:
        seq_id = self._pick(data, self._decoding)
        try:
            self.world.decode(seq_id, token)
        except (OutOfPages, PlanConflict):
            self.m.seqs[seq_id].content.tokens.pop()  # the scheduler would retry the token later

    @rule()
    def step(self) -> None:
        plan = self.world.step()
        for kind in ("swap_in", "swap_out", "copy_prefix", "copy_on_write"):
            if getattr(plan, kind):
                _event(f"plan has {kind}")
        if plan.swap_out and (plan.copy_prefix or plan.copy_on_write):
            _event("plan swaps out and copies")
        self.world.check_live_kv()
        self.world.check_findable_kv()

    @precondition(lambda self: self._any(lambda seq: True))
    @rule(data=st.data(), keep=st.booleans())
    def cancel(self, data: st.DataObject, keep: bool) -> None:
        self.world.release(self._pick(data, lambda seq: True), keep_in_cache=keep)

    @precondition(lambda self: self._any(self._idle))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.world.release(self._pick(data, self._idle), keep_in_cache=True)

    @rule(n=st.integers(1, 4))
    def evict(self, n: int) -> None:
        before = self.m.gpu.num_free
        wanted = min(n, self.m.num_allocatable() - before)
        self.m.evict(n)
        if self.m.gpu.num_free > before:
            _event("evicted pages")
        assert self.m.gpu.num_free >= before + wanted, "eviction freed less than can_allocate promised"

    @precondition(lambda self: self.world is not None)
    @rule()
    def clear_cache(self) -> None:
        """After clearing, no prompt seen before finds a page that no live sequence holds."""
        self.m.clear_cache()
        held = {p for p in range(self.m.gpu.num_pages) if self.m.gpu.refcount[p]}
        for parts in self.history:
            found = set(self.m.lookup(build(parts)).pages_read)
            assert found <= held, f"clear_cache left pages {sorted(found - held)} findable that nothing holds"

    @precondition(lambda self: self._any(self._idle_resident))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        try:
            self.m.swap_out(self._pick(data, self._idle_resident))
        except (OutOfPages, PlanConflict):
            pass

    @precondition(lambda self: self._any(self._swapped))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        try:
            self.m.swap_in(self._pick(data, self._swapped))
        except (OutOfPages, PlanConflict):
            pass

    @precondition(lambda self: self._any(self._idle_resident))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        child, self.next_id = self.next_id, self.next_id + 1
        try:
            self.m.fork(self._pick(data, self._idle_resident), child)
        except PlanConflict:
            pass

    # -- invariants after every rule ---------------------------------------------------------------
    @precondition(lambda self: self.world is not None)
    @invariant()
    def accounting_exact(self) -> None:
        self.m.check_invariants()

    @precondition(lambda self: self.world is not None)
    @invariant()
    def can_allocate_is_what_eviction_frees(self) -> None:
        promised = self.m.num_allocatable()
        dry_run = copy.deepcopy(self.m)
        dry_run.entries.evict_until(dry_run.gpu.num_pages)
        assert dry_run.gpu.num_free == promised, (
            f"can_allocate promises {promised} pages, evicting everything frees {dry_run.gpu.num_free}"
        )

    @precondition(lambda self: self.world is not None)
    @invariant()
    def keys_only_on_full_pages_of_their_content(self) -> None:
        for record in self.m.index.records():
            if record.key is None:
                assert 0 < len(record.tokens) < self.m.page_size
            else:
                assert len(record.tokens) == self.m.page_size
                assert record.key == page_key(record.parent, record.tokens, record.media)

    def teardown(self) -> None:
        if self.world is None:
            return
        self.world.step()  # run what is pending so plan pins are released
        for seq_id in list(self.m.seqs):
            self.world.release(seq_id, keep_in_cache=False)
        self.m.clear_cache()
        self.m.check_invariants()
        assert self.m.gpu.num_free == self.m.gpu.num_pages, "GPU pages leaked"
        assert self.m.cpu.num_free == self.m.cpu.num_pages, "CPU pages leaked"




# The tour's prompts (`kv_strategies.build` parts; pages of 4 tokens): text alone, text around an image whose 6 tokens
# cross two page boundaries ([1 2 3 I] [I I I I] [I 2 2]), and one computed in chunks.
TEXT = [([1, 1, 1, 1], None), ([2, 2, 2], None)]
PICTURE = [([1, 2, 3], None), ([IMAGE_PAD] * 6, DIGESTS[0]), ([2, 2], None)]
CHUNKED = [([3, 3, 3], None), ([IMAGE_PAD] * 4, DIGESTS[1])]


def tour(machine_class: type[KVCacheMachine] = KVCacheMachine) -> None:
    """Every rule, in one fixed order through the sequences' lives, on pages of 4 tokens and a tail-copy threshold of
    2: two prompts admitted into one step (the second sharing the first's whole page), one computed in chunks, a hit
    whose 1-row tail is dropped (its whole pages end outside images), one whose 1-row tail is kept (they end inside
    the image), a 2-row tail copied, a fork decoding into a shared page (copy-on-write), swap out and in, cancel,
    finish (entries sharing pages), evict, clear the cache and the teardown's leak check; the invariants after each
    rule, the KV bytes after each step. Which of these the machine's derandomized examples reach changes with
    Hypothesis's version; the tour reaches each on every run (the planted checks run it first)."""
    m = machine_class()
    m.world = KVWorld(num_gpu_pages=16, page_size=4, num_cpu_pages=4, min_tail_tokens=2,
                      page_aligned_hits=m.page_aligned_hits)

    def then(rule, *args, **kwargs) -> None:
        rule(*args, **kwargs)
        m.accounting_exact()
        m.can_allocate_is_what_eviction_frees()
        m.keys_only_on_full_pages_of_their_content()

    then(m.admit_parts, TEXT, 12)  # sequence 0
    then(m.admit_new_question, Chosen(TEXT, 1), 12, [3])  # 1: [1 1 1 1] [3], in 0's step
    then(m.admit_parts, PICTURE, 12)  # 2
    then(m.admit_parts, CHUNKED, 3)  # 3: its first 3 tokens
    then(m.step)
    then(m.schedule_chunk, Chosen(3), 8)
    then(m.step)
    then(m.admit_new_question, Chosen(TEXT, 1), 12, [2, 3])  # 4: TEXT's page, its 1-row tail dropped
    then(m.admit_new_question, Chosen(PICTURE, 2), 12, [3])  # 5: 2 pages ending in the image, a 1-row tail kept
    then(m.admit_new_question, Chosen(PICTURE, 2), 12, [2, 3])  # 6: 2 pages and a 2-row tail copied
    then(m.step)
    then(m.fork, Chosen(6))  # 7 shares 6's pages
    then(m.decode, Chosen(7), 1)  # into the tail page 6 shares: copied on write
    then(m.step)
    then(m.swap_out, Chosen(0))
    then(m.step)
    then(m.swap_in, Chosen(0))
    then(m.step)
    then(m.cancel, Chosen(4), keep=False)
    then(m.cancel, Chosen(0), keep=True)
    for seq in (1, 2, 3, 5, 6, 7):  # 2, 5, 6 and 7 leave entries sharing PICTURE's whole pages
        then(m.finish, Chosen(seq))
    then(m.evict, 2)
    then(m.clear_cache)
    m.teardown()


def spec_kv_cache_machine() -> None:
    tour(KVCacheMachine)
    run_state_machine_as_test(KVCacheMachine, settings=settings(max_examples=300, stateful_step_count=50,
                                                                deadline=None))


class LongKVCacheRuns(KVCacheMachine):
    """Fewer, longer interleavings: deep states (full pools, chains of hits, swap after CoW)."""


def spec_long_kv_cache_runs() -> None:
    run_state_machine_as_test(LongKVCacheRuns, settings=settings(max_examples=25, stateful_step_count=400,
                                                                 deadline=None))


class DeterministicKVCacheMachine(KVCacheMachine):
    """The same machine with deterministic mode's whole-page hits, which may end inside an image."""

    page_aligned_hits = True

    @initialize(page_size=st.integers(1, 4), num_gpu_pages=st.integers(3, 12), num_cpu_pages=st.integers(0, 4))
    def setup(self, page_size: int, num_gpu_pages: int, num_cpu_pages: int) -> None:
        super().setup(page_size, num_gpu_pages, num_cpu_pages, min_tail_tokens=0)


def spec_deterministic_kv_cache_machine() -> None:
    tour(DeterministicKVCacheMachine)
    run_state_machine_as_test(DeterministicKVCacheMachine, settings=settings(max_examples=100, stateful_step_count=50,
                                                                             deadline=None))
