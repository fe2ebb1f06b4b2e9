"""Continuous batching: which requests compute which token slices this step.

Owns *liveness under a full pool* (invariant 9). Policy, first come first served:
- Running requests go first, oldest first. A request that cannot get pages preempts the youngest
  running requests not yet scheduled this step (swap to CPU or recompute), never itself and never an
  older one; if nothing younger is left it simply waits. So the oldest request always progresses, and
  `max_model_len <= pool capacity` (EngineConfig) means it can always finish.
- Swapped requests come back before new ones are admitted, when they fit without preempting anyone.
- Waiting requests are admitted through the KV manager's exact capacity check (prefix hit included),
  up to `max_num_seqs` and the step's token budget. One whose prompt a running prefill has yet to compute
  `defer_shared_prefill_tokens` or more tokens of (whole pages) waits for it and then hits its pages: requests about
  the same images arriving together compute them once, not once each in the same step. The requests behind it are
  considered (up to `max_num_seqs` passed over per step). A chunk never cuts a visual span: its end snaps
  down to the span start (a chunk starting inside a span, after a deterministic-mode hit, takes the span's
  rest whole or waits); a span larger than the whole budget is rejected with a reason.
- Encoding ahead (`encode_media_ahead`): while others decode, a waiting request whose media are not encoded
  yet has them encoded in a step that computes no prefill (`media_ahead`) and is admitted in a later one.
  Each item is sent ahead once (if its features are evicted meanwhile, the prefill encodes it): a request is
  held back at most once per item. The decoders wait for the vision encoder and for a prefill in different
  steps. (Spreading one request's items over several steps under interleaving was measured and dropped:
  bench/NOTES.md, session 4.) Where the runner encodes them beside the decodes (a stream of its own), the request
  waits until that encoding has finished (`media_ahead_pending`) while others decode, so its first prefill step
  does not wait for the encoder (and the decodes with it).
Nothing here touches tensors: the result is a list of slices plus the KV manager's transfer plan.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..kv.content import MediaSpan, SeqContent
from ..kv.keys import chain_keys
from ..kv.manager import REUSE_FALLBACKS, KVCacheManager
from ..kv.pages import OutOfPages
from ..kv.prefix import PrefixHit
from ..kv.transfers import PlanConflict
from .config import EngineConfig
from .request import Request, RequestState


@dataclass(frozen=True)
class ScheduledSlice:
    """Compute positions [start, end) of `request`; `sample` when that reaches its last known token."""

    request: Request
    start: int
    end: int

    @property
    def sample(self) -> bool:
        return self.end == len(self.request.prompt.token_ids) + len(self.request.output_token_ids)


@dataclass
class SchedulerOutput:
    slices: list[ScheduledSlice] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)  # can never be scheduled, and why
    preempted: list[tuple[Request, Request]] = field(default_factory=list)  # (victim, the request it made room for)
    media_ahead: list = field(default_factory=list)  # PreparedMedia to encode this step for a request admitted next
    media_ahead_for: Request | None = None  # ... that request (still waiting)

    @property
    def media_ahead_requests(self) -> list[Request]:
        """[media_ahead_for] when there is one (it fails with a step that encodes its media ahead)."""
        return [self.media_ahead_for] if self.media_ahead_for is not None else []


def shared_pages(a: list[bytes], b: list[bytes]) -> int:
    """How many leading page keys two chains have in common. A key hashes its parent's, so equal keys at page j mean
    equal keys before it: a binary search finds the last equal one."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; a[hi] != b[hi] or hi is the end
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def snap_chunk_end(content: SeqContent, start: int, end: int) -> int:
    """The largest end <= `end` that does not cut a media span. A chunk starting inside a span (deterministic
    mode's whole-page hits may end inside an image) ends after the span's rest or computes nothing this step."""
    span = content.span_containing(end)
    if span is None:
        return end
    return span.start if span.start >= start else start


def chunk_starts_in_span(span: MediaSpan, start: int) -> bool:
    """Whether a chunk starting at `start` begins with `span` or inside it (after a deterministic-mode hit)."""
    return span.start <= start


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.num_preemptions = 0
        self._decoding = False  # some running request has produced a token (set by each schedule)
        # Whether a media item's features are in the encoder cache (the engine sets the runner's); None: no
        # encoding ahead.
        self.is_media_encoded: Callable[[bytes], bool] | None = None
        # Whether media sent ahead may still be encoding beside the decodes (the engine sets the runner's).
        self.media_ahead_pending: Callable[[], bool] | None = None

    # -- queue management ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def requeue(self, request: Request) -> None:
        """A preempted request goes back to the waiting queue in arrival order."""
        items = sorted([*self.waiting, request], key=lambda r: r.priority)
        self.waiting = deque(items)

    def remove(self, request: Request) -> None:
        """Forget a finished request (its KV references are released by the engine)."""
        for queue in (self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # -- the step ----------------------------------------------------------------------------------
    def schedule(self, skip: frozenset[str] | set[str] = frozenset(), decoding: bool | None = None,
                 preempt: bool = True) -> SchedulerOutput:
        """`skip`: running requests that compute nothing this step (async scheduling: their token in flight ends
        them, so their seats go to waiting requests). `decoding`: whether others decode in this step (default:
        whether a running request has produced a token; scheduled ahead, the tokens in flight are not read yet).
        `preempt`: False when no running request may be preempted (scheduled ahead, each holds a pending slot): one
        that cannot get its pages waits instead."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        self.running.sort(key=lambda r: r.priority)
        self._decoding = any(r.output_token_ids for r in self.running) if decoding is None else decoding

        for request in list(self.running):
            if request.state is not RequestState.RUNNING or budget == 0 or request.request_id in skip:
                continue
            seq = self.kv.seqs[request.request_id]
            end = self.chunk_end(request, seq.content, seq.num_computed, budget)
            if end <= seq.num_computed:
                if budget == self.config.max_num_batched_tokens:  # could never progress: fail, don't spin
                    out.failed.append((request, self._unschedulable_reason(seq.content, seq.num_computed)))
                continue
            if not self._reserve_with_preemption(request, end - seq.num_computed, scheduled, out, preempt):
                break  # nothing younger to preempt: this one and every younger one wait
            out.slices.append(ScheduledSlice(request, seq.num_computed, end))
            scheduled.add(request.request_id)
            budget -= end - seq.num_computed
        prefills = any(s.start < s.request.num_prompt_tokens for s in out.slices)

        self._resume_swapped()

        # New work waits while swapped-out requests wait to come back (they are older). A skipped request's seat is
        # free: its token in flight ends it before this step runs.
        ending = sum(1 for r in self.running if r.request_id in skip)
        deferred = 0  # requests at the head of the queue left waiting for a running prefill of their prompt
        prefilling = self._prefilling()
        while (len(self.waiting) > deferred and not self.swapped and budget > 0
               and len(self.running) - ending < self.config.max_num_seqs):
            request = self.waiting[deferred]
            if prefilling and self._prefilled_elsewhere(request, prefilling):  # (None: deferral is off)
                deferred += 1
                if deferred >= self.config.max_num_seqs:
                    break  # passing over more would scan a long queue of them every step, for seats it has not
                continue
            content = self.content_of(request)
            hit = self.kv.lookup(content)
            end = self.chunk_end(request, content, hit.num_tokens, budget)
            if end <= hit.num_tokens:
                if budget == self.config.max_num_batched_tokens:
                    del self.waiting[deferred]
                    out.failed.append((request, self._unschedulable_reason(content, hit.num_tokens)))
                    continue
                break
            ahead = self._media_to_encode_ahead(request, hit.num_tokens)
            if ahead:
                if self._encodes_ahead_in(prefills):
                    request.media_sent_ahead.update(item.digest for item in ahead)
                    out.media_ahead.extend(ahead)
                    out.media_ahead_for = request
                break  # admitted once its features are ready; FCFS: nobody overtakes it meanwhile
            if self._media_ahead_in_flight(request):
                break  # ... and those encoded beside the decodes are ready when that encoding has finished
            admitted = self._admit(request, content, budget, hit)
            if admitted is None:
                break  # wait for running requests to finish or be preempted
            seq, end = admitted
            del self.waiting[deferred]
            if request.times.first_scheduled is None:
                request.cached_tokens = seq.num_cached
            request.transition(RequestState.RUNNING)
            self.running.append(request)
            out.slices.append(ScheduledSlice(request, seq.num_computed, end))
            scheduled.add(request.request_id)
            budget -= end - seq.num_computed
            prefills = True
            if prefilling is not None:
                prefilling.append((request, seq.num_computed))  # those behind it may wait for it too
        return out

    # -- helpers ---------------------------------------------------------------------------------
    def _prefilling(self) -> list[tuple[Request, int]] | None:
        """(request, positions computed) of the running requests still in their prompts; None when waiting requests
        never wait for them (`defer_shared_prefill_tokens` off, or no prefix cache to hit)."""
        if self.config.defer_shared_prefill_tokens is None or not self.config.enable_prefix_cache:
            return None
        out = []
        for other in self.running:
            seq = self.kv.seqs.get(other.request_id)
            if seq is not None and seq.num_computed < other.num_prompt_tokens:
                out.append((other, seq.num_computed))
        return out

    def _prefilled_elsewhere(self, request: Request, prefilling: list[tuple[Request, int]]) -> bool:
        """Whether one of the `prefilling` requests has yet to compute at least `defer_shared_prefill_tokens` of
        the whole pages its prompt shares with `request`'s (the same tokens and media: equal chain keys). It
        publishes them as it computes them, and `request` hits them once admitted. No lookup: what that request
        has still to compute of the shared pages is not in the cache (or its own admission would have hit it).
        Never for ever: it progresses every step it runs, and once it has left the running requests (finished,
        preempted, swapped) nothing defers `request`."""
        threshold = self.config.defer_shared_prefill_tokens
        assert threshold is not None
        size = self.kv.page_size
        mine = self._prompt_page_keys(request)
        for other, computed in prefilling:
            if len(mine) * size - computed < threshold:
                continue  # even all of `request`'s pages would leave it less than that to compute
            theirs = self._prompt_page_keys(other)
            if shared_pages(mine, theirs) * size - computed >= threshold:
                return True
        return False

    def _prompt_page_keys(self, request: Request) -> list[bytes]:
        if request.prompt_page_keys is None:
            request.prompt_page_keys = chain_keys(request.prompt.kv_content(), self.kv.root, self.kv.page_size)
        return request.prompt_page_keys

    def _media_to_encode_ahead(self, request: Request, hit_tokens: int) -> list:
        """The media items of `request` to encode this step, ahead of its admission: those its prefill will read
        (tokens past the prefix hit) that the encoder has not seen and that were not sent ahead already (once
        each: if the features are evicted meanwhile, the prefill encodes them), while others are decoding."""
        if not self.config.encode_media_ahead or not self._decoding or self.is_media_encoded is None:
            return []
        return list({item.digest: item for item in request.prompt.media  # an image shown twice: encoded once
                     if any(start + length > hit_tokens for start, length in item.spans)
                     and item.digest not in request.media_sent_ahead
                     and not self.is_media_encoded(item.digest)}.values())

    def _media_ahead_in_flight(self, request: Request) -> bool:
        """Whether `request`'s media sent ahead may still be encoding beside the decodes (it would otherwise wait
        for the encoder on the device, in a step with the decodes)."""
        return (bool(request.media_sent_ahead) and self._decoding and self.media_ahead_pending is not None
                and self.media_ahead_pending())

    @staticmethod
    def _encodes_ahead_in(step_prefills: bool) -> bool:
        """A step that computes a prefill already keeps the decoders waiting: the encoding waits a step."""
        return not step_prefills

    def content_of(self, request: Request) -> SeqContent:
        prompt = request.prompt.kv_content()
        return SeqContent(prompt.tokens + request.output_token_ids, prompt.media)

    def chunk_end(self, request: Request, content: SeqContent, start: int, budget: int,
                  decoding: bool | None = None) -> int:
        """Where a chunk of `request` starting at `start` ends within `budget` tokens: no visual span cut, and at
        most `interleave_prefill_tokens` of its prompt while others decode (a longer span goes whole).
        `decoding`: whether others decode in that step (default: as this step's schedule found)."""
        decoding = self._decoding if decoding is None else decoding
        remaining = len(content) - start
        if not self.config.enable_chunked_prefill and start < request.num_prompt_tokens:
            # The prompt goes in one step; a preempted request's recomputed output after it may take more (those
            # tokens were never a prompt: requiring them in the same step turned a request into an ERROR).
            if request.num_prompt_tokens - start > budget:
                return start
            return start + min(remaining, budget)
        end = snap_chunk_end(content, start, start + min(remaining, budget))
        limit = self.config.interleave_prefill_tokens
        if limit is not None and decoding and start < request.num_prompt_tokens and end - start > limit:
            span = content.span_containing(start + limit)
            if span is not None and chunk_starts_in_span(span, start):  # longer than the limit: goes whole
                end = min(end, span.end)
            else:
                end = snap_chunk_end(content, start, start + limit)
        return end

    def _admit(self, request: Request, content: SeqContent, budget: int, whole_hit: PrefixHit):
        """Admit with the whole prefix hit; when nothing runs or waits swapped (so waiting cannot free
        room), fall back to reusing less: a hit pins its pages and a tail page's source, so it can need
        more room than recomputing (liveness: a prompt that fits the pool cold must be admitted).
        `whole_hit`: `kv.lookup(content)`, just done. Returns (the admitted sequence, its chunk's end), or
        None to wait."""
        fallbacks = REUSE_FALLBACKS if not self.running and not self.swapped else REUSE_FALLBACKS[:1]
        for reuse in fallbacks:
            hit = whole_hit if reuse == "all" else self.kv.lookup(content, reuse)
            end = self.chunk_end(request, content, hit.num_tokens, budget)
            if end <= hit.num_tokens:
                continue
            try:
                return self.kv.admit(request.request_id, content, end - hit.num_tokens, reuse=reuse, hit=hit), end
            except OutOfPages:
                continue
        return None

    def _unschedulable_reason(self, content: SeqContent, start: int) -> str:
        span = content.span_containing(start + 1) or next((s for s in content.media if s.start >= start), None)
        if not self.config.enable_chunked_prefill:
            return (
                f"the prompt needs {len(content) - start} tokens in one step but max_num_batched_tokens is "
                f"{self.config.max_num_batched_tokens} and chunked prefill is off"
            )
        size = span.length if span is not None else len(content) - start
        return (
            f"a visual span of {size} tokens cannot be split across chunks and exceeds "
            f"max_num_batched_tokens={self.config.max_num_batched_tokens}"
        )

    def _reserve_with_preemption(
        self, request: Request, num_tokens: int, scheduled: set[str], out: SchedulerOutput, preempt: bool = True
    ) -> bool:
        while True:
            try:
                self.kv.reserve(request.request_id, num_tokens)
                return True
            except OutOfPages:
                if not preempt:
                    return False
                victim = self._youngest_unscheduled(request, scheduled)
                if victim is not None:
                    self._preempt(victim)
                else:
                    # A swapped-out request keeps its shared pages on the GPU; if an older request still
                    # cannot fit, the youngest such request gives them up and recomputes later.
                    victim = self._youngest_swapped_holding_gpu_pages(request)
                    if victim is None:
                        return False
                    self._drop_swapped(victim)
                out.preempted.append((victim, request))

    def _youngest_unscheduled(self, request: Request, scheduled: set[str]) -> Request | None:
        candidates = [
            r
            for r in self.running
            if r.priority > request.priority and r.request_id not in scheduled
        ]
        return max(candidates, key=lambda r: r.priority) if candidates else None

    def _youngest_swapped_holding_gpu_pages(self, request: Request) -> Request | None:
        candidates = [
            r
            for r in self.swapped
            if r.priority > request.priority and any(pool == "gpu" for pool, _ in self.kv.seqs[r.request_id].pages)
        ]
        return max(candidates, key=lambda r: r.priority) if candidates else None

    def _drop_swapped(self, victim: Request) -> None:
        self.num_preemptions += 1
        victim.num_preemptions += 1
        self.swapped.remove(victim)
        self.kv.release(victim.request_id, keep_in_cache=self.config.enable_prefix_cache)
        victim.transition(RequestState.WAITING)
        self.requeue(victim)

    def _preempt(self, victim: Request) -> None:
        self.num_preemptions += 1
        victim.num_preemptions += 1
        self.running.remove(victim)
        if self.config.preemption == "swap":
            try:
                self.kv.swap_out(victim.request_id)
                victim.transition(RequestState.SWAPPED)
                self.swapped.append(victim)
                return
            except (OutOfPages, PlanConflict):
                pass  # no CPU room (or pages pending in this plan): recompute instead
        self.kv.release(victim.request_id, keep_in_cache=self.config.enable_prefix_cache)
        victim.transition(RequestState.WAITING)
        self.requeue(victim)

    def _resume_swapped(self) -> None:
        self.swapped.sort(key=lambda r: r.priority)
        for request in list(self.swapped):
            if len(self.running) >= self.config.max_num_seqs:
                return
            swapped_pages = sum(1 for pool, _ in self.kv.seqs[request.request_id].pages if pool == "cpu")
            if swapped_pages + len(self.running) > self.kv.num_allocatable():
                return  # leave every running request a page to grow into, or it would be swapped right back
            try:
                self.kv.swap_in(request.request_id)
            except (OutOfPages, PlanConflict):
                return
            self.swapped.remove(request)
            request.transition(RequestState.RUNNING)
            self.running.append(request)
