"""The KV cache manager: page tables of live sequences over the page pools, the prefix index and the
cache entries, producing one transfer plan per step.

This is the only way pages change hands, so it is where the invariants meet:
- *publish after compute* (1): `admit` and `reserve` only reserve; `publish_computed(seq, start, end)`,
  called after the step that computed exactly [start, end), is the only caller of the index's publish.
- *tail page without the old key* (2): a prefix boundary inside a page allocates a private page and
  plans `copy_prefix(src, dst, rows)`; the private page gets a key only once it is full and computed.
- *exact refcounts* (6): refcount = page-table references + cache-entry references + plan pins; checked
  by `check_invariants`.
- *can_allocate is exact* (3): free pages plus unique reclaimable pages, minus what an admission pins.
- *>= 1 computed token* (8): a lookup never covers the last prompt token.
- *snapshot transfer plans* (5): moves go through `TransferPlan.add`, which refuses conflicts; a GPU page
  freed by a swap-out in this plan is not handed to a swap-in of the same plan (swap-in runs first).
- *a pending token is never published* (async scheduling): `reserve_pending` makes room for a token the
  device has sampled and the host not yet seen (`PENDING_TOKEN` in the content), `fill_pending` writes it once
  known, and `publish_computed` refuses a range that still holds one: no page key, tail code or cache entry
  is ever made of a placeholder.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Literal

from .content import SeqContent
from .keys import root_key
from .pages import OutOfPages, PagePool
from .prefix import PrefixHit, PrefixIndex
from .reclaim import CacheEntries
from .transfers import Move, PlanConflict, Slot, TransferPlan

SeqId = int | str  # the engine uses request ids


Reuse = Literal["all", "whole_pages", "none"]
# The content entry of a token sampled on the device that the host has not read yet (async scheduling).
PENDING_TOKEN = -1

# What an admission may reuse, from most to least; each later one pins fewer pages.
REUSE_FALLBACKS: tuple[Reuse, ...] = ("all", "whole_pages", "none")


class SequenceError(ValueError):
    """A call that does not fit the sequence's state (unknown id, wrong slice, pages swapped out...)."""


@dataclass
class SeqKV:
    """The KV side of one live sequence."""

    seq_id: SeqId
    content: SeqContent
    pages: list[Slot] = field(default_factory=list)  # logical page j -> (pool, physical page)
    num_computed: int = 0  # positions [0, num_computed) hold finished KV (or KV being copied in)
    keys: list[bytes] = field(default_factory=list)  # chain keys of the full computed pages
    num_cached: int = 0  # tokens that came from the prefix index at admission

    @property
    def is_resident(self) -> bool:
        return all(pool == "gpu" for pool, _ in self.pages)


@dataclass
class CacheStats:
    queries_tokens: int = 0
    hit_tokens: int = 0
    full_page_hits: int = 0
    tail_copies: int = 0
    tail_takeovers: int = 0  # shared tail pages written in place once their cache entries let them go


class KVCacheManager:
    def __init__(
        self,
        num_gpu_pages: int,
        page_size: int,
        namespace: str = "",
        num_cpu_pages: int = 0,
        enable_prefix_cache: bool = True,
        page_aligned_hits: bool = False,
        min_tail_tokens: int = 0,
    ) -> None:
        if isinstance(min_tail_tokens, bool) or not isinstance(min_tail_tokens, int) or min_tail_tokens < 0:
            raise ValueError(f"min_tail_tokens must be a non-negative int, got {min_tail_tokens!r}")
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.page_aligned_hits = page_aligned_hits  # deterministic mode: reuse whole pages only, never a tail
        # A partial page is reused (its rows copied into a private page) only when it holds this many tokens: a
        # copy costs the host ~0.6 ms on the H200 host, and W1's cold prompts shared 4 tokens of chat template.
        self.min_tail_tokens = min_tail_tokens
        self.gpu = PagePool(num_gpu_pages, "gpu")
        self.cpu = PagePool(num_cpu_pages, "cpu")
        self.index = PrefixIndex(page_size)
        self.entries = CacheEntries(self.gpu)
        self.root = root_key(namespace)
        self.gpu.on_reuse = self.index.forget_page
        self.seqs: dict[int, SeqKV] = {}
        self.stats = CacheStats()
        self.plan = TransferPlan()
        self._pins: dict[str, Counter] = {"gpu": Counter(), "cpu": Counter()}
        self._swapped_out_this_plan: set[int] = set()
        self._clock = 0

    # -- capacity -------------------------------------------------------------------------------
    def num_allocatable(self, pinned: tuple[int, ...] | list[int] = ()) -> int:
        """Pages an allocation could get by evicting every cache entry, if `pinned` were referenced first."""
        pinned_set = set(pinned)
        return self._free_unpinned(pinned_set) + len(self.entries.reclaimable_pages() - pinned_set)

    def can_allocate(self, n: int, pinned: tuple[int, ...] | list[int] = ()) -> bool:
        """`n <= num_allocatable(pinned)`, without counting reclaimable pages when free ones suffice: every
        decode step of every running sequence asks, and that count walks every cached page."""
        if n <= 0:
            return True
        pinned_set = set(pinned)
        free = self._free_unpinned(pinned_set)
        return n <= free or n <= free + len(self.entries.reclaimable_pages() - pinned_set)

    def _free_unpinned(self, pinned_set: set[int]) -> int:
        """Free pages, less those `pinned` would reference first."""
        return self.gpu.num_free - self._num_free_among(pinned_set)

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def admission_cost(self, content: SeqContent, reserve_tokens: int, reuse: Reuse = "all",
                       hit: PrefixHit | None = None) -> tuple[PrefixHit, int]:
        """The prefix hit and the number of new GPU pages admitting `content` would allocate. `hit`: what
        `lookup(content, reuse)` returned, reused while the index has not changed since (else looked up again)."""
        if hit is None or hit.found_for != self._lookup_query(content, reuse):
            hit = self.lookup(content, reuse)
        total = self._pages_for(min(hit.num_tokens + reserve_tokens, len(content)))
        return hit, total - len(hit.shared_pages)

    # -- lookup and admission -------------------------------------------------------------------
    def lookup(self, content: SeqContent, reuse: Reuse = "all") -> PrefixHit:
        """The reusable prefix, leaving at least the last prompt token to compute. `reuse` narrows it:
        "whole_pages" drops a partial tail page, "none" reuses nothing (see `REUSE_FALLBACKS`)."""
        query = self._lookup_query(content, reuse)
        if not self.enable_prefix_cache or reuse == "none":
            return PrefixHit((), (), None, 0, self.page_size, query)
        if self.page_aligned_hits:
            # Deterministic mode computes in page-aligned tiles, an image cut at a page boundary taking its features
            # at an offset, exactly as a miss computes that page: a whole-page hit may end inside an image. (Walked
            # back to a boundary outside images, an 8-image prompt at 256-token pages reused nothing.)
            pages, keys = self.index.whole_pages(content, self.root, len(content) - 1)
            return PrefixHit(tuple(pages), tuple(keys), None, 0, self.page_size, query)
        hit = self.index.lookup(content, self.root, len(content) - 1)
        required = reuse == "whole_pages"
        if hit.tail_source is None or not (required or hit.tail_rows < self.min_tail_tokens):
            return replace(hit, found_for=query)
        tokens = len(hit.shared_pages) * self.page_size
        while (span := content.span_containing(tokens)) is not None:  # never end inside an image
            tokens = span.start // self.page_size * self.page_size
        if not required and tokens < len(hit.shared_pages) * self.page_size:
            # A short tail is dropped to save its copy only when that costs just the tail's rows. Here the whole
            # pages end inside an image, so dropping it would recompute that image and everything after the page
            # boundary before it (W5's 4-image prompts at 256-token pages: no hit at all, session 11).
            return replace(hit, found_for=query)
        pages = tokens // self.page_size
        return PrefixHit(hit.shared_pages[:pages], hit.keys[:pages], None, 0, self.page_size, query)

    def _lookup_query(self, content: SeqContent, reuse: Reuse) -> tuple[int, int, str]:
        """What a lookup's result depends on besides the content's tokens (`PrefixHit.found_for`)."""
        return (self.index.version, len(content), reuse)

    def admit(self, seq_id: SeqId, content: SeqContent, reserve_tokens: int, *, reuse: Reuse = "all",
              hit: PrefixHit | None = None) -> SeqKV:
        """Attach the cached prefix (`lookup(content, reuse)`; `hit` if the caller just looked it up, reused
        while the index has not changed since) and reserve pages for up to `reserve_tokens` positions after it.

        Raises OutOfPages (changing nothing) when even evicting every cache entry would not make room. A hit
        can need MORE room than no hit (its pages and a tail page's source are pinned while a private tail
        copy is allocated), so a caller with nothing else to wait for retries with `REUSE_FALLBACKS`.
        """
        if seq_id in self.seqs:
            raise SequenceError(f"sequence {seq_id} is already admitted")
        if len(content) == 0:
            raise SequenceError("cannot admit an empty sequence")
        if reserve_tokens < 0:
            raise SequenceError(f"reserve_tokens={reserve_tokens} is negative")
        hit, new_pages = self.admission_cost(content, reserve_tokens, reuse, hit)
        if not self.can_allocate(new_pages, hit.pages_read):
            raise OutOfPages(f"admitting sequence {seq_id} needs {new_pages} new pages")
        seq = SeqKV(seq_id, content, num_computed=hit.num_tokens, keys=list(hit.keys), num_cached=hit.num_tokens)
        for page in hit.shared_pages:
            self.gpu.incref(page)
            seq.pages.append(("gpu", page))
        if hit.tail_source is not None:
            self._pin(("gpu", hit.tail_source))  # read by copy_prefix; must survive until the plan ran
        fresh = self._allocate_gpu(new_pages)
        seq.pages.extend(("gpu", p) for p in fresh)
        if hit.tail_source is not None:
            dst = fresh[0]
            self.plan.add(Move("copy_prefix", ("gpu", hit.tail_source), ("gpu", dst), hit.tail_rows))
            self.plan.pinned.append(("gpu", hit.tail_source))
            self._pin_for_plan(("gpu", dst))
            self.stats.tail_copies += 1
        self.seqs[seq_id] = seq
        self._clock += 1
        self.entries.touch(hit.pages_read, self._clock)
        self.stats.queries_tokens += len(content)
        self.stats.hit_tokens += hit.num_tokens
        self.stats.full_page_hits += len(hit.shared_pages)
        return seq

    # -- growing and computing -------------------------------------------------------------------
    def append_tokens(self, seq_id: SeqId, tokens: list[int]) -> None:
        """Decode: the sampled tokens become part of the sequence (their KV is computed next step)."""
        self._seq(seq_id).content.tokens.extend(tokens)

    def reserve(self, seq_id: SeqId, num_tokens: int) -> None:
        """Make positions [num_computed, num_computed + num_tokens) writable: allocate pages and
        copy-on-write any page another holder still references (a partly filled tail that only cache entries share
        besides, when the copy does not fit, is taken over instead: the entries give it up). All or nothing."""
        seq = self._seq(seq_id)
        if not seq.is_resident:
            raise SequenceError(f"sequence {seq_id} is swapped out")
        end = seq.num_computed + num_tokens
        if num_tokens <= 0:
            return
        if end > len(seq.content):
            raise SequenceError(f"sequence {seq_id}: reserving past its {len(seq.content)} tokens")
        first = seq.num_computed // self.page_size
        shared = [j for j in range(first, min(len(seq.pages), self._pages_for(end))) if self._is_shared(seq.pages[j][1])]
        new = max(0, self._pages_for(end) - len(seq.pages))
        if not self.can_allocate(new + len(shared)):
            # A fork's partly filled tail page that, besides this sequence, only cache entries still hold: taking it
            # over costs those entries a tail; copying it costs a page the pool may not have. A decide branch as
            # long as the pool forked from its material would otherwise wait for ever (no one younger to preempt).
            taken = [j for j in shared if self._held_otherwise_only_as_cached_tail(seq.pages[j][1])]
            if not taken or not self.can_allocate(new + len(shared) - len(taken)):
                raise OutOfPages(f"sequence {seq_id} needs {new + len(shared)} more pages")
            for j in taken:
                self.entries.give_up_tail(seq.pages[j][1])
                self.stats.tail_takeovers += 1
            shared = [j for j in shared if j not in taken]
        for j in shared:
            src = seq.pages[j][1]
            if ("gpu", src) in self.plan.written():
                raise PlanConflict(f"sequence {seq_id}: page {src} is written earlier in this plan")
            (dst,) = self._allocate_gpu(1)
            self.plan.add(Move("copy_on_write", ("gpu", src), ("gpu", dst)))
            self._pin_for_plan(("gpu", src))
            self._pin_for_plan(("gpu", dst))
            seq.pages[j] = ("gpu", dst)
            self.gpu.decref(src)
        seq.pages.extend(("gpu", p) for p in self._allocate_gpu(new))

    def reserve_pending(self, seq_ids: list[SeqId], chunk: tuple[SeqId, int] | None = None) -> bool:
        """Async scheduling: each sequence, fully computed, gets a `PENDING_TOKEN` and a writable slot for it,
        and `chunk` = (sequence, n), if given, its next n known positions writable (a prefill chunk launched
        beside them), all of them or none. False (nothing changed) when a slot would need a copy-on-write (a
        transfer) or the pages do not fit without preempting anyone: the caller then schedules the step normally."""
        new_pages = 0
        for seq_id in seq_ids:
            seq = self._seq(seq_id)
            n = len(seq.content)
            if not seq.is_resident or seq.num_computed != n:  # (a pending token is never computed)
                return False
            if self._pages_for(n + 1) > len(seq.pages):
                new_pages += 1
            elif self._is_shared(seq.pages[n // self.page_size][1]):
                return False
        if chunk is not None:
            seq_id, num_tokens = chunk
            seq = self._seq(seq_id)
            start, end = seq.num_computed, seq.num_computed + num_tokens
            if (seq_id in seq_ids or not seq.is_resident or num_tokens <= 0 or end > len(seq.content)
                    or PENDING_TOKEN in seq.content.tokens[start:end]):
                return False
            written = range(start // self.page_size, min(len(seq.pages), self._pages_for(end)))
            if any(self._is_shared(seq.pages[j][1]) for j in written):
                return False
            new_pages += max(0, self._pages_for(end) - len(seq.pages))
        if not self.can_allocate(new_pages):
            return False
        for seq_id in seq_ids:
            self.seqs[seq_id].content.tokens.append(PENDING_TOKEN)
            self.reserve(seq_id, 1)
        if chunk is not None:
            self.reserve(*chunk)
        return True

    def fill_pending(self, seq_id: SeqId, token: int) -> None:
        """The host has read the token `reserve_pending` made room for: it replaces the placeholder."""
        tokens = self._seq(seq_id).content.tokens
        if not tokens or tokens[-1] != PENDING_TOKEN:
            raise SequenceError(f"sequence {seq_id} has no pending token to fill")
        tokens[-1] = token

    def publish_computed(self, seq_id: SeqId, start: int, end: int) -> None:
        """A finished step computed exactly positions [start, end): publish what became complete."""
        seq = self._seq(seq_id)
        if start != seq.num_computed or not start < end <= len(seq.content):
            raise SequenceError(f"sequence {seq_id}: publish [{start}, {end}) but {seq.num_computed} computed")
        if PENDING_TOKEN in seq.content.tokens[start:end]:
            raise SequenceError(f"sequence {seq_id}: [{start}, {end}) holds a token the host has not read yet")
        if end > len(seq.pages) * self.page_size or not seq.is_resident:
            raise SequenceError(f"sequence {seq_id}: positions up to {end} have no resident page")
        written = range(start // self.page_size, self._pages_for(end))
        if any(self._is_shared(seq.pages[j][1]) for j in written):
            raise SequenceError(f"sequence {seq_id}: [{start}, {end}) was written into a shared page")
        size = self.page_size
        tokens = seq.content.tokens
        for j in range(len(seq.keys), end // size):
            lo = j * size
            media = seq.content.media_runs(lo, lo + size)
            key = self.index.publish_full(seq.pages[j][1], self._parent_key(seq), tuple(tokens[lo : lo + size]), media)
            seq.keys.append(key)
        if end % size:
            lo = end - end % size
            page = seq.pages[end // size][1]
            self.index.publish_partial(page, self._parent_key(seq), tuple(tokens[lo:end]), seq.content.media_runs(lo, end))
        seq.num_computed = end

    # -- ending --------------------------------------------------------------------------------
    def release(self, seq_id: SeqId, keep_in_cache: bool = True) -> None:
        """Finish or cancel: drop the sequence's references; optionally keep its findable pages as an entry."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            raise SequenceError(f"unknown sequence {seq_id}")
        if keep_in_cache and self.enable_prefix_cache and seq.is_resident and seq.num_computed > 0:
            full = seq.num_computed // self.page_size
            kept = [p for _, p in seq.pages[:full] if self.index.is_findable(p)]
            tail = None
            if seq.num_computed % self.page_size:
                candidate = seq.pages[full][1]
                if self.index.is_findable(candidate):
                    tail = candidate
            if kept or tail is not None:
                self._clock += 1
                self.entries.add(kept, tail, seq.num_computed, self._clock)
        for pool, page in seq.pages:
            (self.gpu if pool == "gpu" else self.cpu).decref(page)

    def evict(self, num_pages: int) -> None:
        """Evict cache entries until `num_pages` more pages are free (or nothing is left)."""
        self.entries.evict_until(self.gpu.num_free + num_pages)

    def clear_cache(self) -> None:
        """Forget the cache: every entry dropped, and the records of pages nobody holds any more with them (a freed
        page stays findable until the pool hands it out again, so dropping the entries alone left it to be hit).
        Afterwards nothing computed before is reused, except pages live sequences still hold."""
        self.entries.clear()
        for page in self.gpu.free_pages():
            self.index.forget_page(page)

    # -- forks and swapping ----------------------------------------------------------------------
    def fork(self, seq_id: SeqId, child_id: SeqId, content: SeqContent | None = None) -> SeqKV:
        """A child sharing the computed pages of `seq_id` (copy-on-write happens in `reserve`). `content`: the
        child's whole content when it goes on past the parent's (a decision's question after its material: tokens
        and media of its own), which must begin with the parent's content; default, the parent's.

        Pages reserved but not yet computed stay the parent's alone: the parent may already be
        scheduled to write them."""
        seq = self._seq(seq_id)
        if child_id in self.seqs:
            raise SequenceError(f"sequence {child_id} already exists")
        if not seq.is_resident:
            raise SequenceError(f"sequence {seq_id} is swapped out")
        n = len(seq.content)
        if content is not None and (content.tokens[:n] != seq.content.tokens
                                    or tuple(m for m in content.media if m.start < n) != seq.content.media):
            raise SequenceError(f"the content of {child_id} does not begin with the content of {seq_id}")
        self._refuse_pending_writes(seq)
        shared = seq.pages[: self._pages_for(seq.num_computed)]
        child = SeqKV(
            child_id,
            SeqContent(list(seq.content.tokens), seq.content.media) if content is None
            else SeqContent(list(content.tokens), content.media),
            list(shared),
            seq.num_computed,
            list(seq.keys),
            seq.num_cached,
        )
        for _, page in shared:
            self.gpu.incref(page)
        self.seqs[child_id] = child
        return child

    def swap_out(self, seq_id: SeqId) -> int:
        """Move the pages only this sequence holds to the CPU pool. Returns how many moved."""
        seq = self._seq(seq_id)
        self._refuse_pending_writes(seq)
        moving = [j for j, (pool, p) in enumerate(seq.pages) if pool == "gpu" and not self._is_shared(p)]
        if len(moving) > self.cpu.num_free:
            raise OutOfPages(f"CPU swap pool: {len(moving)} pages needed, {self.cpu.num_free} free")
        for j in moving:
            gpu_page = seq.pages[j][1]
            (cpu_page,) = self.cpu.allocate(1)
            self.plan.add(Move("swap_out", ("gpu", gpu_page), ("cpu", cpu_page)))
            self._pin_for_plan(("cpu", cpu_page))
            seq.pages[j] = ("cpu", cpu_page)
            self.gpu.decref(gpu_page)
            self._swapped_out_this_plan.add(gpu_page)
        return len(moving)

    def swap_in(self, seq_id: SeqId) -> int:
        """Bring a swapped-out sequence's pages back to the GPU pool. Returns how many moved."""
        seq = self._seq(seq_id)
        self._refuse_pending_writes(seq)  # swapped out in this very plan: its CPU copy does not exist yet
        moving = [j for j, (pool, _) in enumerate(seq.pages) if pool == "cpu"]
        if len(moving) > self.num_allocatable() - self._num_free_among(self._swapped_out_this_plan):
            raise OutOfPages(f"swap-in of sequence {seq_id} needs {len(moving)} GPU pages")
        fresh = self._allocate_gpu(len(moving), exclude=self._swapped_out_this_plan)
        for j, gpu_page in zip(moving, fresh, strict=True):
            cpu_page = seq.pages[j][1]
            self.plan.add(Move("swap_in", ("cpu", cpu_page), ("gpu", gpu_page)))
            self._pin_for_plan(("gpu", gpu_page))
            seq.pages[j] = ("gpu", gpu_page)
            self.cpu.decref(cpu_page)
        return len(moving)

    # -- plans -----------------------------------------------------------------------------------
    def take_plan(self) -> TransferPlan:
        """The moves to execute before this step's model run; pins stay until `finish_plan`."""
        plan, self.plan = self.plan, TransferPlan()
        self._swapped_out_this_plan = set()
        return plan

    def finish_plan(self, plan: TransferPlan) -> None:
        for pool, page in plan.pinned:
            self._pins[pool][page] -= 1
            if self._pins[pool][page] == 0:
                del self._pins[pool][page]
            (self.gpu if pool == "gpu" else self.cpu).decref(page)
        plan.pinned.clear()

    # -- checks ----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Refcounts exact (tables + entries + plan pins), pools consistent, chains and counters sane."""
        for name, pool in (("gpu", self.gpu), ("cpu", self.cpu)):
            pool.check_consistent()
            expected = Counter(p for s in self.seqs.values() for where, p in s.pages if where == name)
            expected.update(self._pins[name])
            if name == "gpu":
                expected.update(self.entries.entry_refs)
            for page in range(pool.num_pages):
                if pool.refcount[page] != expected.get(page, 0):
                    raise AssertionError(
                        f"{name} page {page}: refcount {pool.refcount[page]} != references {expected.get(page, 0)}"
                    )
        brute = {p for p in range(self.gpu.num_pages) if 0 < self.entries.entry_refs.get(p, 0) == self.gpu.refcount[p]}
        if brute != self.entries.reclaimable_pages():
            raise AssertionError("reclaimable pages disagree with a recount")
        self.index.check_media_counts()
        for seq in self.seqs.values():
            if len(seq.keys) != seq.num_computed // self.page_size:
                raise AssertionError(f"sequence {seq.seq_id}: {len(seq.keys)} keys for {seq.num_computed} tokens")
            if seq.num_computed > len(seq.pages) * self.page_size:
                raise AssertionError(f"sequence {seq.seq_id}: computed tokens without pages")

    # -- internals -------------------------------------------------------------------------------
    def _seq(self, seq_id: SeqId) -> SeqKV:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise SequenceError(f"unknown sequence {seq_id}")
        return seq

    def _is_shared(self, page: int) -> bool:
        return self.gpu.refcount[page] - self._pins["gpu"][page] > 1

    def _held_otherwise_only_as_cached_tail(self, page: int) -> bool:
        """One page-table reference (the caller's), the rest cache entries' tail references (and plan pins, which
        only read rows already computed)."""
        others = self.gpu.refcount[page] - self._pins["gpu"][page] - self.entries.entry_refs.get(page, 0)
        return others == 1 and self.entries.holds_only_as_tail(page)

    def _num_free_among(self, pages: set[int] | frozenset[int]) -> int:
        return sum(1 for p in pages if self.gpu.is_free(p))

    def _allocate_gpu(self, n: int, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
        self.entries.evict_until(n + self._num_free_among(exclude))
        return self.gpu.allocate(n, exclude)

    def _parent_key(self, seq: SeqKV) -> bytes:
        """The chain key the sequence's next page hangs from."""
        return seq.keys[-1] if seq.keys else self.root

    def _pin(self, slot: Slot) -> None:
        pool, page = slot
        (self.gpu if pool == "gpu" else self.cpu).incref(page)
        self._pins[pool][page] += 1

    def _pin_for_plan(self, slot: Slot) -> None:
        self._pin(slot)
        self.plan.pinned.append(slot)

    def _refuse_pending_writes(self, seq: SeqKV) -> None:
        written = self.plan.written()
        if any(slot in written for slot in seq.pages):
            raise PlanConflict(f"sequence {seq.seq_id} has pages written by the pending plan; run it first")
