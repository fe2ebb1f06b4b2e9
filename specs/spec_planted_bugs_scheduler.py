"""Proof that the scheduler's specs bite: each historical bug of its liveness (deadlocks, admission, preemption,
encoding ahead, chunks and visual spans, recompute with chunked prefill off) and of computing a shared material once,
planted.

Each test monkeypatches one buggy variant into the real Scheduler (or what it calls) and requires the spec that owns
the invariant to fail (see `specs/planted.py`).
"""

from __future__ import annotations

import pytest

from specs.planted import _spec_fails


def test_deferring_to_a_stopped_prefill_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefills a waiting request may wait for are the ones running now. Planted (found by a review of the
    specs): they are remembered across steps and forgotten only once their prompt is done, so one aborted mid-prompt
    still holds back the requests sharing its image, for ever."""
    from prism.engine import scheduler as scheduler_module
    from specs import spec_scheduler_liveness

    prefilling = scheduler_module.Scheduler._prefilling

    def remembered(self):
        now = prefilling(self)
        if now is None:
            return None
        seen = self.__dict__.setdefault("_planted_seen", {})
        seen.update((r.request_id, (r, c)) for r, c in now)
        for r in self.running:  # its prompt done: forgotten
            seq = self.kv.seqs.get(r.request_id)
            if seq is not None and seq.num_computed >= r.num_prompt_tokens:
                seen.pop(r.request_id, None)
        live = {r.request_id for r, _ in now}
        return now + [v for k, v in seen.items() if k not in live]

    monkeypatch.setattr(scheduler_module.Scheduler, "_prefilling", remembered)
    with pytest.raises(AssertionError, match="no progress"):
        spec_scheduler_liveness.spec_a_request_deferred_behind_a_cancelled_prefill_goes_ahead()


def test_equal_priority_deadlock_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the liveness spec: two requests of equal priority on a full pool (decision branches share
    their material's arrival order) each waited for the other, forever."""
    from prism.engine import request as request_module
    from specs import spec_scheduler_liveness

    init = request_module.Request.__init__

    def init_without_tiebreak(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.priority = (self.arrival_order, 0)

    monkeypatch.setattr(request_module.Request, "__init__", init_without_tiebreak)
    _spec_fails(spec_scheduler_liveness.spec_every_request_terminates_on_a_tight_pool, "no progress")


def test_admission_without_reuse_fallback_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the liveness spec: admission only ever tried the whole prefix hit, which can need more
    pages than a cold admission (pinned hit pages + a tail copy), so a lone prompt waited forever."""
    from prism.engine import scheduler as scheduler_module
    from specs import spec_scheduler_liveness

    monkeypatch.setattr(scheduler_module, "REUSE_FALLBACKS", ("all",))
    _spec_fails(spec_scheduler_liveness.spec_a_prompt_that_fits_cold_is_admitted_despite_its_hit, "no progress")


def test_swapped_request_keeping_shared_pages_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the liveness spec: preemption never took back the GPU pages a swapped-out request shares
    with the cache, so an older request that needed them and the swapped one waited on each other."""
    from prism.engine import scheduler as scheduler_module
    from specs import spec_scheduler_liveness

    monkeypatch.setattr(scheduler_module.Scheduler, "_youngest_swapped_holding_gpu_pages", lambda self, request: None)
    _spec_fails(spec_scheduler_liveness.spec_a_swapped_request_gives_up_the_shared_pages_an_older_one_needs,
                "no progress")


def test_encoding_ahead_without_its_once_flag_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Encoding ahead must hold a request back at most once per media item: without remembering what was sent
    ahead, an encoder cache that evicted the features before admission holds it back again at every step
    while others decode (TTFT unbounded)."""
    from prism.engine import scheduler as scheduler_module
    from specs import spec_scheduler_liveness

    def ahead_every_time(self, request, hit_tokens):
        if not self.config.encode_media_ahead or not self._decoding or self.is_media_encoded is None:
            return []
        return [m for m in request.prompt.media if not self.is_media_encoded(m.digest)]

    monkeypatch.setattr(scheduler_module.Scheduler, "_media_to_encode_ahead", ahead_every_time)
    _spec_fails(spec_scheduler_liveness.spec_every_request_terminates_on_a_tight_pool, "held back twice")


def test_encoding_ahead_beside_a_prefill_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: two cold requests back to back had the second one's images encoded in the step that
    prefilled the first, so the decoders waited for both in one step, what encoding ahead exists to avoid."""
    from prism.engine import scheduler as scheduler_module
    from specs import spec_scheduler_liveness

    monkeypatch.setattr(scheduler_module.Scheduler, "_encodes_ahead_in", staticmethod(lambda step_prefills: True))
    _spec_fails(spec_scheduler_liveness.spec_every_request_terminates_on_a_tight_pool,
                "encoded media ahead and computed a prefill")


def test_admission_during_the_encoding_beside_the_decodes_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 13: the media encoded ahead run on a side stream beside the decodes; a request admitted before that
    encoding has finished makes its first prefill step wait for the encoder on the device, and the decodes with it."""
    from prism.engine import scheduler as scheduler_module
    from specs import spec_scheduler_liveness

    monkeypatch.setattr(scheduler_module.Scheduler, "_media_ahead_in_flight", lambda self, request: False)
    _spec_fails(spec_scheduler_liveness.spec_every_request_terminates_on_a_tight_pool,
                "admitted while its media encoded ahead may still be encoding")


def test_a_chunk_cutting_the_rest_of_an_image_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review (session 12): once deterministic mode's hits could end inside an image, a chunk starting
    there was not snapped (only spans starting at or after the chunk start were), so the image's rest could be
    split over steps, against the scheduler's promise that a chunk never cuts a visual span."""
    from prism.engine import scheduler as scheduler_module
    from specs import spec_scheduler_liveness

    def snap_ignoring_a_span_begun_before(content, start, end):
        span = content.span_containing(end)
        return span.start if span is not None and span.start >= start else end

    monkeypatch.setattr(scheduler_module, "snap_chunk_end", snap_ignoring_a_span_begun_before)
    monkeypatch.setattr(scheduler_module, "chunk_starts_in_span", lambda span, start: span.start == start)
    _spec_fails(spec_scheduler_liveness.spec_every_request_terminates_with_deterministic_hits, "cut a visual span")


def test_recompute_required_in_one_step_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 27): with chunked prefill off, a preempted request's recompute (its prompt and the
    tokens it had generated) had to fit one step, so a request preempted late was failed. Planted: the whole content
    in one step again."""
    from prism.engine.scheduler import Scheduler
    from specs import spec_unchunked_recompute

    chunk_end = Scheduler.chunk_end

    def whole_content(self, request, content, start, budget, decoding=None):
        if not self.config.enable_chunked_prefill and start < request.num_prompt_tokens:
            remaining = len(content) - start
            return start + remaining if remaining <= budget else start
        return chunk_end(self, request, content, start, budget, decoding)

    monkeypatch.setattr(Scheduler, "chunk_end", whole_content)
    _spec_fails(spec_unchunked_recompute.spec_no_request_fails_with_chunked_prefill_off, "failed with chunked")


def test_a_material_computed_beside_its_running_prefill_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found on the H200 (session 23): 32 decides over 4 materials, submitted together, were admitted in the same
    steps and computed each material 8 times (W7: 1.05 s of the burst's 1.4 s of kernels were GEMMs). Planted: no
    waiting request ever waits for a running prefill of its prompt."""
    from prism.engine import scheduler as scheduler_module
    from specs import spec_shared_prefill

    monkeypatch.setattr(scheduler_module.Scheduler, "_prefilled_elsewhere", lambda self, request, prefilling: False)
    _spec_fails(spec_shared_prefill.spec_a_material_asked_about_together_is_computed_once, "computed again")
