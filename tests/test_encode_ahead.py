"""Encoding media ahead (`EngineConfig.encode_media_ahead`, on by default): while other requests decode, a new
request's uncached images are encoded in one step and its prefill runs in the next, so the decoders never wait
for the vision encoder and the prefill in the same step. Real engine, tiny checkpoint, CPU."""

from __future__ import annotations

import time

import pytest

from prism.engine.llm import LLM
from prism.engine.request import RequestState
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images

IMAGES = random_images([(64, 64), (48, 80)], seed=11)
GREEDY = SamplingParams.greedy(max_tokens=4, ignore_eos=True)
MAX_STEPS = 30  # a cold request among decodes is prefilled within a few steps: more is a hang, not a slow test


def cold_request():
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in IMAGES),
                                         {"type": "text", "text": "What do you see?"}]}]


def engine(**overrides):
    """These tests are about encoding in a step ahead of the prefill: images are not encoded while preparing."""
    overrides.setdefault("encode_media_while_preparing", False)
    return LLM(ensure_tiny_checkpoint(), page_size=8, num_gpu_pages=256, check_invariants=True, **overrides).engine


def run_until_done(eng, requests) -> dict[str, list[int]]:
    """Step to the end; the generated tokens of `requests`."""
    while eng.has_unfinished_requests():
        eng.step()
    return {r.request_id: list(r.output_token_ids) for r in requests}


def record_steps(eng) -> list[tuple[set[str], int]]:
    """Every step the runner executes from now on, as (the requests it computes, the media items it encodes). Steps,
    not `step()` calls: with async admissions one call may launch the step that encodes ahead and the next."""
    steps: list[tuple[set[str], int]] = []
    runner, stats = eng.runner, eng.runner.stats

    def recorded(execute):
        def run(slices, *args, **kwargs):
            before = stats.vision_items_encoded
            try:
                return execute(slices, *args, **kwargs)
            finally:
                chunk = kwargs.get("chunk")
                ids = {s.request.request_id for s in slices} | ({chunk.request.request_id} if chunk else set())
                steps.append((ids, stats.vision_items_encoded - before))
        return run

    runner.execute, runner.execute_decode_rows = recorded(runner.execute), recorded(runner.execute_decode_rows)
    return steps


def inject_cold_into_decodes(eng):
    """Two text requests decoding, then the cold 2-image request arrives: returns (every request, the steps from its
    arrival to its first prefill step, that one included, or to its failure, as `record_steps` gives them)."""
    texts = [eng.add_request(f"text{i}", f"Count to ten, number {i}.",
                             SamplingParams.greedy(max_tokens=12, ignore_eos=True)) for i in range(2)]
    for _ in range(3):
        eng.step()
    steps = record_steps(eng)
    cold = eng.add_request("cold", cold_request(), GREEDY)
    for _ in range(MAX_STEPS):
        if cold.is_finished or any("cold" in ids for ids, _ in steps):  # (its encoding may fail it)
            return [*texts, cold], list(steps)
        eng.step()
    pytest.fail(f"the cold request was not prefilled within {MAX_STEPS} steps: {steps}")


def test_a_cold_request_among_decodes_has_its_images_encoded_one_step_before_its_prefill():
    decoders = {"text0", "text1"}
    for admissions in (False, True):
        eng = engine(async_admissions=admissions)
        requests, steps = inject_cold_into_decodes(eng)
        assert steps == [(decoders, len(IMAGES)), (decoders | {"cold"}, 0)], (
            "the images are encoded in a step of the decodes alone, the prefill reads the encoder cache in the next")
        assert eng.runner.stats.encoder_cache_hits >= len(IMAGES)
        ahead = run_until_done(eng, requests)
        assert len(ahead["cold"]) == GREEDY.max_tokens

        plain = engine(encode_media_ahead=False, async_admissions=admissions)
        requests_plain, steps_plain = inject_cold_into_decodes(plain)
        assert steps_plain == [(decoders | {"cold"}, len(IMAGES))], "off: encoded in the prefill's step"
        assert run_until_done(plain, requests_plain) == ahead, (
            "encoding ahead changes when the features are computed, not the tokens")


def test_nothing_waits_when_nobody_decodes():
    eng = engine()
    cold = eng.add_request("cold", cold_request(), GREEDY)
    eng.step()
    assert cold.state is RequestState.RUNNING and cold.output_token_ids, "alone, the request is prefilled at once"
    assert not cold.media_encoded_ahead


def test_images_already_encoded_are_not_held_back():
    eng = engine()
    run_until_done(eng, [eng.add_request("warm", cold_request(), GREEDY)])
    for i in range(2):
        eng.add_request(f"text{i}", f"Count to ten, number {i}.", SamplingParams.greedy(max_tokens=12, ignore_eos=True))
    for _ in range(3):
        eng.step()
    again = eng.add_request("again", cold_request(), GREEDY)
    eng.step()
    assert again.state is RequestState.RUNNING and not again.media_encoded_ahead


def test_images_of_chat_messages_are_encoded_while_the_others_are_prepared():
    """Chat messages given to the engine: each new image is encoded as soon as it is prepared (before any step),
    the prefill then reads the encoder cache; the tokens are the engine's without it. Images whose pages the
    prefix cache holds are not encoded again, even with their features evicted."""
    out = {}
    for early in (False, True):
        eng = engine(encode_media_while_preparing=early)
        stats = eng.runner.stats
        cold = eng.add_request("cold", cold_request(), GREEDY)
        assert stats.vision_items_encoded == (len(IMAGES) if early else 0)
        out[early] = run_until_done(eng, [cold])["cold"]
        assert stats.vision_items_encoded == len(IMAGES), "each image is encoded once, early or in the prefill"
    assert out[True] == out[False]

    eng.runner.encoder_cache.clear()
    again = eng.add_request("again", cold_request(), GREEDY)  # a full prefix hit: its pages hold both images
    assert stats.vision_items_encoded == len(IMAGES)
    run_until_done(eng, [again])
    assert again.cached_tokens > 0 and stats.vision_items_encoded == len(IMAGES)


def test_an_image_whose_early_encoding_fails_is_encoded_by_its_prefill(monkeypatch, caplog):
    eng = engine(encode_media_while_preparing=True)

    def broken(items):
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng.runner, "encode_ahead", broken)
    cold = eng.add_request("cold", cold_request(), GREEDY)
    assert "encoding an image while its request was prepared failed" in caplog.text
    run_until_done(eng, [cold])
    assert len(cold.output_token_ids) == GREEDY.max_tokens and eng.runner.stats.vision_items_encoded == len(IMAGES)



def held_back_while_pending(eng, pending_steps: int) -> tuple[list, list[int], dict[str, list[int]]]:
    """The cold request among decodes, with the runner's encoding beside the decodes reported as unfinished for
    `pending_steps` queries after its media were sent ahead (the CPU has no side stream: the query is faked).
    Returns (every request, the media items each step encoded from its arrival until its prefill, the tokens at
    the end)."""
    queries = {"left": pending_steps}

    def pending() -> bool:
        if queries["left"] == 0:
            return False
        queries["left"] -= 1
        return True

    eng.scheduler.media_ahead_pending = pending
    texts = [eng.add_request(f"text{i}", f"Count to ten, number {i}.",
                             SamplingParams.greedy(max_tokens=12, ignore_eos=True)) for i in range(2)]
    for _ in range(3):
        eng.step()
    steps = record_steps(eng)
    cold = eng.add_request("cold", cold_request(), GREEDY)
    for _ in range(MAX_STEPS):
        if cold.state is not RequestState.WAITING:
            break
        eng.step()
    else:
        pytest.fail(f"the cold request was not admitted within {MAX_STEPS} steps: {steps}")
    waiting = steps[: next(i for i, (ids, _) in enumerate(steps) if "cold" in ids)]
    assert all({"text0", "text1"} <= ids for ids, _ in waiting), "the running requests decode in every step the cold one waits"
    return [*texts, cold], [encoded for _, encoded in waiting], run_until_done(eng, [*texts, cold])


def check_waits_for_media_encoded_beside_the_decodes() -> None:
    for admissions in (False, True):
        _, encoded, tokens = held_back_while_pending(engine(async_admissions=admissions), pending_steps=3)
        assert encoded == [len(IMAGES), 0, 0, 0], encoded  # the encoding step, then 3 pending queries
        _, encoded_plain, tokens_plain = held_back_while_pending(engine(async_admissions=admissions), pending_steps=0)
        assert encoded_plain == [len(IMAGES)]
        assert tokens == tokens_plain


def test_a_request_waits_for_its_media_encoded_beside_the_decodes():
    """Media encoded ahead on the runner's side stream (`encode_ahead_beside_decodes`): the request is admitted
    once that encoding has finished, never while it may still run (its prefill would wait for it on the device,
    holding the decodes of its step); the tokens are those of an engine that never waits."""
    check_waits_for_media_encoded_beside_the_decodes()


def test_the_wait_for_media_encoded_beside_the_decodes_can_fail(monkeypatch):
    """Planted: a scheduler that does not ask whether the encoding has finished admits the request at once."""
    from prism.engine.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_media_ahead_in_flight", lambda self, request: False)
    with pytest.raises(AssertionError):
        check_waits_for_media_encoded_beside_the_decodes()


def decodes_beside_a_failing_encoding(monkeypatch, encoding_first: bool = False) -> tuple[dict, dict, object]:
    """Two text requests decode; a cold image request arrives and the vision encoder fails on its images (planted)
    in the step that encodes them ahead (`encoding_first`: launched before a step scheduled ahead, as beside the
    decodes; the CPU schedules ahead through the graphs' rows run eagerly). Returns (the decoders' tokens, the same
    decoders' tokens with no cold request, the cold request)."""
    from prism.engine import runner as runner_module

    settings = {"async_admissions": True, "graph_rows_without_cuda": True} if encoding_first else {}

    def plain_decodes():
        eng = engine(**settings)
        texts = [eng.add_request(f"text{i}", f"Count to ten, number {i}.",
                                 SamplingParams.greedy(max_tokens=12, ignore_eos=True)) for i in range(2)]
        return run_until_done(eng, texts)

    want = plain_decodes()

    def failing(*args, **kwargs):
        raise RuntimeError("planted vision failure")

    monkeypatch.setattr(runner_module, "encode_media_items", failing)
    eng = engine(**settings)
    launched_first = []
    if encoding_first:
        encode = eng.runner.encode_beside_decodes
        monkeypatch.setattr(eng.runner, "encodes_beside_decodes", lambda: True)
        monkeypatch.setattr(eng.runner, "encode_beside_decodes", lambda items: launched_first.append(encode(items)))
    requests, _ = inject_cold_into_decodes(eng)
    got = run_until_done(eng, requests[:2])
    assert len(launched_first) == encoding_first, launched_first
    assert not eng.kv.seqs and not eng.has_unfinished_requests()
    monkeypatch.undo()  # the engine keeps serving
    after = eng.add_request("after", cold_request(), GREEDY)
    run_until_done(eng, [after])
    assert len(after.output_token_ids) == GREEDY.max_tokens
    return got, want, requests[-1]


def test_a_failed_encoding_ahead_fails_its_request_and_not_the_decodes(monkeypatch):
    """The media encoded ahead belong to a waiting request: if the encoder fails on them, that request ends with
    an error and the requests decoding in the same step go on, their tokens unchanged; nothing leaks, and the
    engine keeps serving (until session 14 the whole step failed, every decode in it with an error)."""
    got, want, cold = decodes_beside_a_failing_encoding(monkeypatch)
    assert got == want, "the decoders must finish as if the cold request had never come"
    assert cold.is_finished and cold.finish_reason.value == "error" and "planted vision failure" in cold.error


def test_a_failed_encoding_launched_before_the_decode_rows_fails_its_request_only(monkeypatch):
    """The same where the encoding ahead is launched before a step scheduled ahead (`async_steps.encode_ahead_first`)."""
    got, want, cold = decodes_beside_a_failing_encoding(monkeypatch, encoding_first=True)
    assert got == want, "the decoders must finish as if the cold request had never come"
    assert cold.is_finished and cold.finish_reason.value == "error" and "planted vision failure" in cold.error


def test_the_host_waits_for_the_encoding_ahead_or_the_step_in_flight_before_the_next_launch(monkeypatch):
    """With async scheduling the next step is scheduled while the one before runs, so a request held back by its
    media encoding beside the decodes would be asked about a step early. The engine first waits for that encoding
    or the step in flight (its `ready` event) and the configured pause, whichever ends first
    (`ModelRunner.encoding_finished_before`), in each step launched while such a request waits, and in no other;
    the tokens do not change. The CPU has no side stream and no events: the runner reports an encoding running
    throughout, and each step in flight gets a stand-in event."""
    from prism.engine.inflight import InflightStep

    eng = engine(async_admissions=True, encode_ahead_decode_pause_ms=3.5)
    launch = InflightStep.launch.__func__
    readies: list[object] = []
    waits: list[tuple] = []

    class Ready:
        def synchronize(self) -> None:
            pass

    def with_ready(cls, sampled, result):
        step = launch(cls, sampled, result)
        step.ready = Ready()
        readies.append(step.ready)
        return step

    def finished_before(event, pause_s) -> bool:
        waits.append(([r.request_id for r in eng.scheduler.waiting], event is readies[-1], pause_s))
        return False

    monkeypatch.setattr(InflightStep, "launch", classmethod(with_ready))
    monkeypatch.setattr(eng.runner, "encoding_finished_before", finished_before)
    monkeypatch.setattr(eng.runner, "encoding_in_background", lambda: True)
    _, encoded, tokens = held_back_while_pending(eng, pending_steps=3)
    assert encoded == [len(IMAGES), 0, 0, 0], encoded
    # The wait comes first in each step after its encoding's: the three that held it back and the one admitting it.
    assert waits == [(["cold"], True, 3.5e-3)] * 4, waits
    monkeypatch.undo()
    _, _, tokens_plain = held_back_while_pending(engine(async_admissions=True), pending_steps=3)
    assert tokens == tokens_plain


def test_steps_scheduled_after_their_tokens_are_read_do_not_wait_for_the_encoding_ahead(monkeypatch):
    """Without async scheduling (and in deterministic mode) a step is scheduled after the device has finished the one
    before: nothing to wait for, and a pause would only idle the device."""
    for settings in ({"async_scheduling": False}, {"deterministic": True}):
        eng = engine(**settings)
        waits = []
        monkeypatch.setattr(eng.runner, "encoding_finished_before", lambda event, pause_s, into=waits: into.append(event))
        monkeypatch.setattr(eng.runner, "encoding_in_background", lambda: True)
        held_back_while_pending(eng, pending_steps=2)
        assert waits == [], settings


class FakeEvent:
    """A CUDA event's `query` for `BackgroundEncoding.finished_before`: complete after `after` queries."""

    def __init__(self, after: int) -> None:
        self.after, self.queries = after, 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.after


def finished_before(encoding_after: int | None, step_after: int | None, pause_s: float = 0.0) -> bool:
    from prism.engine.background_encoding import BackgroundEncoding

    background = object.__new__(BackgroundEncoding)  # no CUDA stream on the CPU: only the host's wait is tested
    background._launched = None if encoding_after is None else FakeEvent(encoding_after)
    return background.finished_before(None if step_after is None else FakeEvent(step_after), pause_s, poll_s=0)


def test_the_wait_for_an_encoding_ahead_ends_with_whichever_ends_first():
    assert finished_before(None, 5)  # nothing launched: nothing to wait for
    assert finished_before(0, None)  # already finished
    assert not finished_before(3, None)  # no step in flight: never waits
    assert finished_before(3, 10)  # the encoding ends first
    assert not finished_before(10, 3)  # the step in flight ends first, and no pause
    assert finished_before(10, 3, pause_s=10.0)  # ... the encoding ends in the pause after it (not 10 s later)
    t = time.perf_counter()
    assert not finished_before(10**12, 3, pause_s=0.02)  # the pause ends first
    assert time.perf_counter() - t >= 0.02


def test_beside_the_decodes_the_encoding_ahead_is_launched_before_the_steps_decode_rows(monkeypatch):
    """Where media encode beside the decodes, the step scheduled ahead that sends a waiting request's media launches
    their encoding first, then waits as for an encoding already running, then launches its decode rows with no
    media left to encode (the encoder starts alone on the device). The CPU has no side stream: the runner is told
    it has one, encodes at once, and the tokens are those of the plain engine. (The CPU schedules ahead through the
    graphs' rows run eagerly.)"""
    eng = engine(async_admissions=True, graph_rows_without_cuda=True)
    order: list[str] = []
    encode_beside, execute = eng.runner.encode_beside_decodes, eng.runner.execute

    def launched_first(items):
        order.append(f"encode {len(items)}")
        return encode_beside(items)

    def step(slices, kv, plan, media_ahead=(), **kwargs):
        order.append(f"step {len(media_ahead)}")
        return execute(slices, kv, plan, media_ahead, **kwargs)

    monkeypatch.setattr(eng.runner, "encodes_beside_decodes", lambda: True)
    monkeypatch.setattr(eng.runner, "encode_beside_decodes", launched_first)
    monkeypatch.setattr(eng.runner, "execute", step)
    _, _, tokens = held_back_while_pending(eng, pending_steps=0)
    assert f"encode {len(IMAGES)}" in order, order
    at = order.index(f"encode {len(IMAGES)}")
    assert order[at + 1] == "step 0", order  # the step launched after it encodes nothing
    assert all(entry == "step 0" for entry in order if entry.startswith("step")), order
    assert eng.runner.stats.vision_items_encoded == len(IMAGES)
    assert eng.stats.scheduled_ahead_steps > 0
    _, _, tokens_plain = held_back_while_pending(engine(async_admissions=True, graph_rows_without_cuda=True),
                                                 pending_steps=0)
    assert tokens == tokens_plain
