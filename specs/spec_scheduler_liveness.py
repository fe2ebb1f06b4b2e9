"""Spec of liveness under a full pool (REFERENCE §2, invariant 9), on the real Scheduler and KVCacheManager.

Random prompts (with atomic visual spans), random max_tokens, a tight pool, chunked prefill, recompute or swap
preemption, and random cancels. The step loop stands in for the engine's commit only where the model would
be (a computed slice is published; a slice that reaches the end samples a token). Checked:
- every accepted request reaches exactly one terminal state, within a step bound once arrivals stop;
- no chunk ever cuts a visual span, and a running request is only ever preempted by an older one;
- the KV manager's accounting is exact after every step, and nothing leaks at the end;
- with encoding ahead (`encode_media_ahead`, over a stand-in encoder cache that may forget everything after
  every step), each media item of a request is encoded ahead at most once, and never in a step with a prefill;
  with that encoding running beside the decodes for a random number of steps (a stand-in for the runner's side
  stream, `media_ahead_pending`), a request whose media were sent ahead is never admitted while it may still run
  and others decode, and every request still terminates.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from prism.engine.config import EngineConfig
from prism.engine.request import FinishReason, Request
from prism.engine.sampling import SamplingParams
from prism.engine.scheduler import Scheduler
from prism.kv.content import MediaSpan, SeqContent
from prism.kv.manager import KVCacheManager


@dataclass(frozen=True)
class FakePrompt:
    """What the scheduler reads of a prompt: its tokens and media spans."""

    token_ids: list[int]
    spans: tuple[MediaSpan, ...]

    def kv_content(self) -> SeqContent:
        return SeqContent(list(self.token_ids), self.spans)

    @property
    def media(self) -> list[FakeMedia]:
        """One media item per span (what encoding ahead reads: digest and token spans)."""
        return [FakeMedia(span.digest, ((span.start, span.length),)) for span in self.spans]


@dataclass(frozen=True)
class FakeMedia:
    digest: bytes
    spans: tuple[tuple[int, int], ...]


@st.composite
def prompts(draw) -> FakePrompt:
    tokens: list[int] = []
    spans = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            length = draw(st.integers(2, 10))
            spans.append(MediaSpan(len(tokens), length, bytes([draw(st.integers(1, 3))]) * 16))
            tokens += [9] * length
        tokens += draw(st.lists(st.integers(1, 4), min_size=1, max_size=6))
    return FakePrompt(tokens, tuple(spans))


@st.composite
def prompts_sharing_images(draw) -> list[FakePrompt]:
    """Prompts made of leading blocks (images, text) of a few shared bases plus a question of their own, so later
    ones hit what earlier ones computed, whole-page hits often ending inside an image."""
    bases = [draw(st.lists(st.one_of(st.tuples(st.integers(2, 10), st.integers(1, 3)),
                                     st.lists(st.integers(1, 4), min_size=1, max_size=4)), min_size=1, max_size=4))
             for _ in range(draw(st.integers(1, 2)))]
    out = []
    for _ in range(draw(st.integers(2, 6))):
        base = draw(st.sampled_from(bases))
        tokens: list[int] = []
        spans = []
        for block in base[: draw(st.integers(1, len(base)))]:
            if isinstance(block, tuple):  # an image: (length, which digest)
                spans.append(MediaSpan(len(tokens), block[0], bytes([block[1]]) * 16))
                tokens += [9] * block[0]
            else:
                tokens += block
        tokens += draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))  # the question
        out.append(FakePrompt(tokens, tuple(spans)))
    return out


def run(requests, arrivals, cancels, preemption: str, pool_pages: int, budget: int,
        interleave: int | None = None, encode_ahead: bool = False, forgetful_encoder: bool = False,
        page_aligned_hits: bool = False, encode_steps: list[int] | None = None, defer: int | None = None,
        max_num_seqs: int = 4, chunked_prefill: bool = True) -> dict:
    """Run the requests to their ends; returns the steps, the preemptions, the prompt tokens computed in all and the
    requests the scheduler failed. `defer`: `defer_shared_prefill_tokens` (waiting for a running prefill of the same
    prompt pages). `chunked_prefill` False: a prompt longer than the budget is refused, as the engine refuses it."""
    config = EngineConfig(page_size=4, num_gpu_pages=pool_pages, num_cpu_pages=8 if preemption == "swap" else 0,
                          preemption=preemption, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          interleave_prefill_tokens=interleave, encode_media_ahead=encode_ahead,
                          defer_shared_prefill_tokens=defer, enable_chunked_prefill=chunked_prefill)
    kv = KVCacheManager(pool_pages, 4, "spec", config.num_cpu_pages, page_aligned_hits=page_aligned_hits)
    scheduler = Scheduler(config, kv, max_model_len=pool_pages * 4)
    encoded: set[bytes] = set()  # the stand-in encoder cache
    scheduler.is_media_encoded = encoded.__contains__
    # The stand-in side stream: each encoding ahead runs for the next of `encode_steps` steps (0: done at once).
    durations = list(encode_steps or [])
    busy_until = {"step": 0}
    if encode_steps is not None:
        scheduler.media_ahead_pending = lambda: step < busy_until["step"]
    held_back: dict[tuple[str, bytes], int] = {}
    live: dict[str, Request] = {}
    terminal: dict[str, int] = {}
    pending = list(zip(arrivals, requests, strict=True))
    step = 0
    prompt_tokens_computed = 0
    failed = 0
    limit = 400 + 60 * len(requests)

    def finish(request: Request, reason: FinishReason) -> None:
        if request.request_id in kv.seqs:
            kv.release(request.request_id, keep_in_cache=True)
        scheduler.remove(request)
        request.finish(reason)
        terminal[request.request_id] = terminal.get(request.request_id, 0) + 1
        live.pop(request.request_id)

    while pending or live:
        assert step < limit, f"no progress: {len(live)} requests still live after {step} steps"
        for arrival, (prompt, max_tokens) in [p for p in pending if p[0] <= step]:
            request = Request(f"r{len(terminal) + len(live)}-{arrival}-{step}", prompt, SamplingParams(max_tokens=max_tokens), step)
            if len(prompt.token_ids) + 1 > kv.gpu.num_pages * 4 or (not chunked_prefill and len(prompt.token_ids) > budget):
                continue  # the engine refuses these at add_request
            live[request.request_id] = request
            scheduler.add(request)
        pending = [p for p in pending if p[0] > step]
        if step in cancels and live:
            finish(sorted(live.values(), key=lambda r: r.arrival_order)[cancels[step] % len(live)], FinishReason.ABORT)
        pending_now = encode_steps is not None and step < busy_until["step"]
        decoding = any(r.output_token_ids for r in scheduler.running)
        waiting_before = {r.request_id for r in scheduler.waiting}
        out = scheduler.schedule()
        for s in out.slices:
            admitted = s.request.request_id in waiting_before
            assert not (admitted and s.request.media_sent_ahead and pending_now and decoding), \
                "a request was admitted while its media encoded ahead may still be encoding beside the decodes"
        if out.media_ahead and encode_steps is not None:
            busy_until["step"] = step + 1 + (durations.pop(0) if durations else 0)
        for victim, preemptor in out.preempted:
            assert victim.priority > preemptor.priority, "a request was preempted by a younger one"
        for request, _reason in out.failed:
            finish(request, FinishReason.ERROR)
            failed += 1
        if out.media_ahead:  # the head of the queue was held back while its media are encoded
            assert all(s.start >= s.request.num_prompt_tokens for s in out.slices), \
                "a step both encoded media ahead and computed a prefill"
            head = out.media_ahead_for
            assert {m.digest for m in out.media_ahead} <= {m.digest for m in head.prompt.media}
            for digest in {m.digest for m in out.media_ahead}:  # a prompt may show one image twice
                key = (head.request_id, digest)
                held_back[key] = held_back.get(key, 0) + 1
                assert held_back[key] == 1, "a request was held back twice to encode the same media item ahead"
        encoded.update(m.digest for m in out.media_ahead)
        encoded.update(m.digest for s in out.slices for m in s.request.prompt.media)
        plan = kv.take_plan()
        for s in out.slices:
            content = scheduler.content_of(s.request)
            assert content.span_containing(s.end) is None, "a chunk cut a visual span"
            prompt_tokens_computed += max(0, min(s.end, s.request.num_prompt_tokens) - s.start)
            kv.publish_computed(s.request.request_id, s.start, s.end)
        kv.finish_plan(plan)
        for s in out.slices:
            if not s.sample or s.request.is_finished:
                continue
            request = s.request
            request.output_token_ids.append(1)
            if len(request.output_token_ids) >= request.params.max_tokens or \
                    request.num_prompt_tokens + len(request.output_token_ids) >= scheduler.max_model_len:
                finish(request, FinishReason.LENGTH)
            else:
                kv.append_tokens(request.request_id, [1])
        kv.check_invariants()
        if forgetful_encoder:
            encoded.clear()
        step += 1
    assert all(count == 1 for count in terminal.values()), "a request reached two terminal states"
    assert not kv.seqs
    kv.clear_cache()
    kv.check_invariants()
    assert kv.gpu.num_free == kv.gpu.num_pages and kv.cpu.num_free == kv.cpu.num_pages, "pages leaked"
    return {"steps": step, "preemptions": scheduler.num_preemptions, "prompt_tokens_computed": prompt_tokens_computed,
            "failed": failed}


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(st.tuples(prompts(), st.integers(1, 8)), min_size=1, max_size=8),
    data=st.data(),
    preemption=st.sampled_from(["recompute", "swap"]),
    pool_pages=st.integers(8, 16),
    budget=st.integers(12, 24),
    interleave=st.one_of(st.none(), st.integers(1, 12)),
    encode_ahead=st.booleans(),
    forgetful_encoder=st.booleans(),
    encode_steps=st.one_of(st.none(), st.lists(st.integers(0, 4), max_size=6)),
)
def spec_every_request_terminates_on_a_tight_pool(requests, data, preemption, pool_pages, budget,
                                                   interleave, encode_ahead, forgetful_encoder, encode_steps) -> None:
    arrivals = data.draw(st.lists(st.integers(0, 12), min_size=len(requests), max_size=len(requests)))
    cancels = data.draw(st.dictionaries(st.integers(0, 30), st.integers(0, 7), max_size=3))
    run(requests, arrivals, cancels, preemption, pool_pages, budget, interleave, encode_ahead, forgetful_encoder,
        encode_steps=encode_steps if encode_ahead else None)


@settings(max_examples=60, deadline=None)
@given(
    shared=prompts_sharing_images(),
    data=st.data(),
    preemption=st.sampled_from(["recompute", "swap"]),
    pool_pages=st.integers(8, 16),
    budget=st.integers(10, 16),  # the step's budget left for a chunk is often below an image's rest
    interleave=st.one_of(st.none(), st.integers(1, 2), st.integers(1, 6)),  # an image's rest after a page is < 4
)
def spec_every_request_terminates_with_deterministic_hits(shared, data, preemption, pool_pages, budget,
                                                         interleave) -> None:
    """Deterministic mode's whole-page hits, which may end inside an image: a chunk starting there takes the
    image's rest whole (never cut, even under an interleave limit), and every request still terminates. The
    first request decodes long and the others arrive later: they hit its pages while it decodes."""
    requests = [(prompt, data.draw(st.integers(6, 12) if i == 0 else st.integers(1, 8)))
                for i, prompt in enumerate(shared)]
    arrivals = [0] + data.draw(st.lists(st.integers(2, 12), min_size=len(requests) - 1, max_size=len(requests) - 1))
    cancels = data.draw(st.dictionaries(st.integers(0, 30), st.integers(0, 7), max_size=3))
    run(requests, arrivals, cancels, preemption, pool_pages, budget, interleave, page_aligned_hits=True)


# A spec of its own (the two above keep their draws, which the planted checks' derandomized examples depend on).
@settings(max_examples=100, deadline=None)
@given(
    shared=prompts_sharing_images(),
    data=st.data(),
    preemption=st.sampled_from(["recompute", "swap"]),
    pool_pages=st.integers(8, 16),
    budget=st.integers(10, 24),
    interleave=st.one_of(st.none(), st.integers(1, 6)),
    encode_ahead=st.booleans(),
    deterministic=st.booleans(),
    defer=st.sampled_from([1, 4, 8]),
)
def spec_every_request_terminates_while_shared_prefills_are_deferred(shared, data, preemption, pool_pages, budget,
                                                                     interleave, encode_ahead, deterministic,
                                                                     defer) -> None:
    """Requests over shared images wait for each other's prefills (`defer_shared_prefill_tokens`), on a tight pool
    with preemption, cancels, chunking and encoding ahead: each still terminates (no request waits for a prefill
    that has stopped, none holds up those behind it for ever)."""
    requests = [(prompt, data.draw(st.integers(1, 8))) for prompt in shared]
    arrivals = data.draw(st.lists(st.integers(0, 6), min_size=len(requests), max_size=len(requests)))
    cancels = data.draw(st.dictionaries(st.integers(0, 30), st.integers(0, 7), max_size=3))
    run(requests, arrivals, cancels, preemption, pool_pages, budget, interleave, encode_ahead,
        page_aligned_hits=deterministic, defer=defer)


# A request deferred behind another's prefill of the same image, which is then cancelled mid-prompt: the deferred
# one must go ahead, not wait for a prefill that has stopped. The drawn spec above reached such a case in 3 of its 100
# examples and missed a scheduler that kept deferring to stopped prefills (found by a review of the specs, session 28).
_P = FakePrompt([1, 2, 3] + [9] * 10 + [1, 2, 3, 4] * 5 + [2, 2], (MediaSpan(3, 10, b"\x01" * 16),))
DEFERRED_BEHIND_A_CANCELLED_PREFILL = ([(_P, 2), (FakePrompt(_P.token_ids[:-1] + [4], _P.spans), 2)], [0, 1], {2: 0})


def spec_a_request_deferred_behind_a_cancelled_prefill_goes_ahead() -> None:
    requests, arrivals, cancels = DEFERRED_BEHIND_A_CANCELLED_PREFILL
    run(requests, arrivals, cancels, "recompute", pool_pages=16, budget=10, defer=4)


# The counterexample this spec found: a 15-token prompt leaves its pages cached; a 29-token prompt on an
# 8-page pool hits them, but the hit pins 4 pages and its tail copy needs a fifth fresh one, so admission
# with the hit never fits although the prompt fits cold. Kept as a fixed example.
HIT_NEEDS_MORE_THAN_COLD = (
    [
        (FakePrompt([1, 3, 3] + [9] * 10 + [1] * 4 + [9] * 10 + [1, 1],
                    (MediaSpan(3, 10, b"\x03" * 16), MediaSpan(17, 10, b"\x01" * 16))), 1),
        (FakePrompt([1, 3, 3] + [9] * 10 + [1, 1], (MediaSpan(3, 10, b"\x03" * 16),)), 1),
    ],
    [2, 0],
)


def spec_a_prompt_that_fits_cold_is_admitted_despite_its_hit() -> None:
    requests, arrivals = HIT_NEEDS_MORE_THAN_COLD
    run(requests, arrivals, {}, "recompute", pool_pages=8, budget=14)


# The second counterexample: an older request needs room that a younger, swapped-out request still pins
# (swap-out moves only a sequence's private pages; pages it shares with the cache stay on the GPU, held by
# it). Preempting the younger one freed nothing, it was swapped back in, preempted again, forever.
_D = b"\x01" * 16
SWAPPED_PINS_SHARED_PAGES = (
    [
        (FakePrompt([1], ()), 1),
        (FakePrompt([1], ()), 1),
        (FakePrompt([9, 9, 9] + [1] * 6 + [9, 9, 3, 1, 1, 1], (MediaSpan(0, 3, _D), MediaSpan(9, 2, _D))), 3),
        (FakePrompt([9, 9, 9] + [1] * 6 + [9, 9, 3] + [1] * 5, (MediaSpan(0, 3, _D), MediaSpan(9, 2, _D))), 2),
        (FakePrompt([9, 9, 1, 9, 9] + [1] * 6 + [9] * 4 + [1] * 6,
                    (MediaSpan(0, 2, _D), MediaSpan(3, 2, _D), MediaSpan(11, 4, _D))), 1),
    ],
    [0, 0, 0, 3, 2],
)


def spec_a_swapped_request_gives_up_the_shared_pages_an_older_one_needs() -> None:
    requests, arrivals = SWAPPED_PINS_SHARED_PAGES
    run(requests, arrivals, {}, "swap", pool_pages=9, budget=12)
