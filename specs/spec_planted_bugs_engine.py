"""Proof that the engine's specs bite: each historical bug of hit == miss on the real engine (tail copies, deterministic
tiles, the graphs' positions), async scheduling and admissions, failed steps, sampling beside other rows, the LLM's
event routing, stop strings at the last flush, the config's checks and the detokenizer's cost, planted.

Each test monkeypatches one buggy variant into the real engine and requires the spec that owns the invariant to fail
(see `specs/planted.py`).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from prism.engine.request import RequestError
from prism.kv.manager import KVCacheManager, SequenceError
from specs import spec_failed_steps
from specs.planted import _engines_shared_whatever, _spec_fails, _the_next_example_fails_for_what_one_left


def _hit_equals_miss_fails(spec_name: str, match: str) -> None:
    """`_spec_fails` on a hit == miss spec, with fresh engines (they are cached across examples): the planted
    bug must be in the engines the spec builds, and must not stay in them afterwards."""
    from specs import spec_hit_equals_miss

    spec_hit_equals_miss.engine.cache_clear()
    try:
        _spec_fails(getattr(spec_hit_equals_miss, spec_name), match)
    finally:
        spec_hit_equals_miss.engine.cache_clear()


def test_tail_copy_dropping_a_row_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 11 on the real engine: a tail copy one row short leaves the hit reading a row nobody wrote."""
    _copy_tail_pages_one_row_short(monkeypatch)
    _hit_equals_miss_fails("spec_a_prefix_hit_gives_the_logits_of_a_miss", "a prefix hit changed")


def test_partial_hits_with_a_tail_copy_one_row_short_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Partial hits (each prompt its own images, some shared): a hit's partly filled tail page is copied into a
    private page, all its cached rows. Planted (found by a review of the specs: the partial specs had no planted
    check): the copy one row short."""
    _copy_tail_pages_one_row_short(monkeypatch)
    _hit_equals_miss_fails("spec_partial_hits_give_the_logits_of_misses", "a prefix hit changed")


def test_an_example_without_graph_rows_after_one_with_them_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review of the specs sharing engines: the hit == miss spec checked that the graphs ran by its shared
    engine's counts since it was built, so once one example had run graph rows, every later one passed that check
    whether it ran any or not. Planted: after a first example, the row graphs never fit (every decode eager)."""
    from prism.engine.cuda_graphs import RowGraphs
    from specs import spec_hit_equals_miss

    case = dict(images=[0], questions=["What is it?", "Why?"], page_size=4, budget=512, deterministic=False,
                graphs="rows")
    spec_hit_equals_miss.engine.cache_clear()
    try:
        spec_hit_equals_miss.check(**case)
        monkeypatch.setattr(RowGraphs, "fits", lambda self, num_rows, max_context: False)
        with pytest.raises(AssertionError, match="no decode ran as graph rows"):
            spec_hit_equals_miss.check(**case)
    finally:
        spec_hit_equals_miss.engine.cache_clear()


def _copy_tail_pages_one_row_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted in the runner's transfer plans: every tail copy (`copy_prefix`) one row short."""
    from prism.engine import runner

    execute = runner.execute_plan

    def execute_one_row_short(plan, gpu, cpu):
        short = [(src, dst, rows - 1) for src, dst, rows in plan.copy_prefix]
        execute(dataclasses.replace(plan, copy_prefix=short), gpu, cpu)

    monkeypatch.setattr(runner, "execute_plan", execute_one_row_short)


def test_deterministic_tile_starting_at_the_hit_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 11, deterministic mode: a hit ending inside a page, computed from the hit onwards instead of
    from the page start, gives the frontier page's rows other tile positions than a miss does."""
    from prism.engine import step_building

    init = KVCacheManager.__init__

    def tail_hits_allowed(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "page_aligned_hits": False})

    def tiles_from_the_hit(slices, size):
        tiles = []
        for s in slices:
            start = s.start
            while start < s.end:
                page_end = (start // size + 1) * size
                end = min(page_end, s.end)
                tiles.append([(s, start, end, page_end - end, s.sample and end == s.end)])
                start = end
        return tiles

    monkeypatch.setattr(KVCacheManager, "__init__", tail_hits_allowed)
    monkeypatch.setattr(step_building, "deterministic_tiles", tiles_from_the_hit)
    _hit_equals_miss_fails("spec_deterministic_mode_hit_equals_miss_bitwise", "changed the logits")


def test_graph_rows_one_position_ahead_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 11 through the CUDA graphs' one-token rows: rows that rotate each token as the next one (an
    off-by-one in the per-row positions) make a question after a hit differ from the packed miss."""
    from prism.engine import cuda_graphs

    from_pieces = cuda_graphs.GraphRows.from_pieces.__func__

    def one_position_ahead(cls, pieces, page_size):
        rows = from_pieces(cls, pieces, page_size)
        return dataclasses.replace(rows, positions=rows.positions + 1)

    monkeypatch.setattr(cuda_graphs.GraphRows, "from_pieces", classmethod(one_position_ahead))
    _hit_equals_miss_fails("spec_a_prefix_hit_gives_the_logits_of_a_miss", "a prefix hit changed")


def test_packed_graph_steps_one_position_ahead_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariant 11 through the packed graphs: a packed step that rotates each token as the next one makes the
    cached engine's prompts (packed) differ from the cache-off engine's eager ones."""
    from prism.engine import packed_graphs

    from_pieces = packed_graphs.PackedStep.from_pieces.__func__

    def one_position_ahead(cls, pieces, media, page_size):
        step = from_pieces(cls, pieces, media, page_size)
        return dataclasses.replace(step, positions=step.positions + 1)

    monkeypatch.setattr(packed_graphs.PackedStep, "from_pieces", classmethod(one_position_ahead))
    _hit_equals_miss_fails("spec_a_prefix_hit_gives_the_logits_of_a_miss", "a prefix hit changed")


def test_continuation_fed_another_rows_tokens_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async scheduling: a decode step launched on the previous step's device tokens must take each sequence's
    own token. Planted: the rows' tokens in reverse order."""
    from prism.engine.inflight import InflightStep
    from specs import spec_async_scheduling

    device_tokens_of = InflightStep.device_tokens_of

    def reversed_rows(self, rows):
        return device_tokens_of(self, rows).flip(0)

    monkeypatch.setattr(InflightStep, "device_tokens_of", reversed_rows)
    _spec_fails(spec_async_scheduling.spec_async_scheduling_gives_the_tokens_of_scheduled_steps,
                "async scheduling changed the tokens")


def test_pending_token_appended_instead_of_filled_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async scheduling: the token the host reads replaces its sequence's pending placeholder. Planted: it is
    appended after it, so the placeholder stays in the content (and would reach a page key)."""
    from specs.spec_async_scheduling import AsyncSchedulingMachine

    def appended(self, seq_id, token):
        self.append_tokens(seq_id, [token])

    monkeypatch.setattr(KVCacheManager, "fill_pending", appended)
    _async_machine_fails(AsyncSchedulingMachine, "not what the host read|has not read yet")


def test_appended_device_tokens_are_caught_with_admissions_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same planted bug as above, against the machine whose steps are scheduled ahead while requests are
    admitted (`AsyncAdmissionsMachine`: it had no planted check, found by a review of the specs)."""
    from specs.spec_async_scheduling import AsyncAdmissionsMachine

    def appended(self, seq_id, token):
        self.append_tokens(seq_id, [token])

    monkeypatch.setattr(KVCacheManager, "fill_pending", appended)
    _async_machine_fails(AsyncAdmissionsMachine, "not what the host read|has not read yet")


def _async_machine_fails(machine, match: str) -> None:
    """An async scheduling machine's tour (`spec_async_scheduling.tour`), then its examples, fail with `match`
    (SequenceError: the KV manager's own guard caught it): the tour reaches every rule whatever examples Hypothesis
    draws."""
    from specs.spec_async_scheduling import tour

    with pytest.raises((AssertionError, SequenceError), match=match):
        tour(machine)
        run_state_machine_as_test(machine, settings=settings(
            max_examples=40, stateful_step_count=20, deadline=None, phases=[Phase.generate], database=None,
            derandomize=True))


def test_an_async_tour_past_its_landmarks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by session 34's review of the tours: the async tour's stop (and any request decoding past its first token,
    which the planted checks above need) came from the tiny checkpoint's tokens, and nothing noticed if a change of
    them took the tour past those states. Planted: "stops" requests that never stop, as other weights could make
    them; the tour must say that it no longer reaches its stop."""
    from specs import spec_async_scheduling

    params_of = spec_async_scheduling.params_of

    def never_stopping(kind, max_tokens, seed, vocab):
        params = params_of(kind, max_tokens, seed, vocab)
        return dataclasses.replace(params, stop_token_ids=()) if kind == "stops" else params

    monkeypatch.setattr(spec_async_scheduling, "params_of", never_stopping)
    with pytest.raises(AssertionError, match="the tour no longer reaches: r1 stopped on a stop token"):
        spec_async_scheduling.tour(spec_async_scheduling.AsyncSchedulingMachine)


def test_an_engine_a_failed_example_left_requests_in_is_not_shared_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review of the stateful specs: the async machine's examples share an engine and each names its
    requests r0, r1, ... again, so an example that failed with a request left in the engine failed the ones after it
    too (their r3 refused as already in use, or the leftover stepped beside their own requests): a request the
    scheduler never saw was reported as Hypothesis's "Inconsistent data generation", not as itself. Planted: the
    engine shared whatever an example left in it; a tour that fails leaving r3 (the scheduler never sees it) must fail
    the next tour."""
    from prism.engine.scheduler import Scheduler
    from specs import spec_async_scheduling

    _engines_shared_whatever(monkeypatch)
    add = Scheduler.add
    with monkeypatch.context() as lost:
        lost.setattr(Scheduler, "add", lambda self, request: None if request.request_id == "r3" else add(self, request))
        with pytest.raises(AssertionError, match="r3: 0 terminal events"):
            spec_async_scheduling.tour(spec_async_scheduling.AsyncSchedulingMachine)
    with pytest.raises(RequestError, match="request id 'r3' is already in use"):
        spec_async_scheduling.tour(spec_async_scheduling.AsyncSchedulingMachine)


def test_a_stopped_requests_logits_row_taken_for_another_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async scheduling: when a request stops on the token the host just read, its row of the launched step is
    dropped and the others' logits rows are picked out. Found by review: no spec covered it. Planted: the first
    rows are taken instead of the live ones."""
    from prism.engine import engine as engine_module
    from specs import spec_async_scheduling

    monkeypatch.setattr(engine_module, "take_rows", lambda logits, rows: logits[: len(rows)])
    _spec_fails(spec_async_scheduling.spec_async_scheduling_gives_the_tokens_of_scheduled_steps,
                "async scheduling changed the")


def test_continuation_chunk_steps_without_the_device_tokens_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async scheduling with chunks: decode rows launched beside a prefill chunk replay the packed graphs, and
    their input ids are the previous step's device tokens, copied after the host's ids. Planted: the device
    tokens never reach the packed step (the rows keep the host's placeholder ids)."""
    from prism.engine.packed_graphs import PackedGraphs
    from specs import spec_async_scheduling

    run = PackedGraphs.run

    def without_device_tokens(self, step, multimodal, token_ids=None):
        return run(self, step, multimodal)

    monkeypatch.setattr(PackedGraphs, "run", without_device_tokens)
    _spec_fails(spec_async_scheduling.spec_async_scheduling_gives_the_tokens_of_scheduled_steps,
                "async scheduling changed the")


def test_scheduling_ahead_without_the_pending_slots_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async admissions: the scheduler runs while a step is in flight only after each decode row's pending slot is
    reserved, so it sees a one-token decode for each. Planted: the slots are not reserved (the scheduler then finds
    nothing to compute for the decoding requests)."""
    from prism.engine import async_steps, continuation
    from prism.engine.request import RequestState
    from specs import spec_async_scheduling

    def without_pending_slots(current, scheduler, kv, max_model_len):
        if not scheduler.waiting or scheduler.swapped or not kv.plan.is_empty():
            return None
        rows = [(i, s.request) for i, s in enumerate(current.sampled) if s.request.state is RequestState.RUNNING]
        if len(rows) != len(scheduler.running):
            return None
        skip = {r.request_id for _, r in rows if continuation.stops_by_length_after_next(r, max_model_len)}
        return [(i, r) for i, r in rows if r.request_id not in skip], skip

    monkeypatch.setattr(async_steps, "rows_scheduled_ahead", without_pending_slots)  # looked up there
    _spec_fails(spec_async_scheduling.spec_async_admissions_give_the_tokens_of_scheduled_steps,
                "async admissions changed the")


def test_decode_rows_scheduled_ahead_taken_for_non_sampling_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async admissions: when the step is launched, a decode row's token is not read yet, so its slice does not
    yet end at the request's last known token (`ScheduledSlice.sample` is false); it samples all the same, and its
    logits row must be counted. Planted: the rows that sample are judged by `sample` alone (found by review as a
    mapping no spec planted)."""
    from prism.engine import async_steps
    from specs import spec_async_scheduling

    monkeypatch.setattr(async_steps, "samples_at_launch", lambda slices, pending: [s.sample for s in slices])
    _spec_fails(spec_async_scheduling.spec_async_admissions_give_the_tokens_of_scheduled_steps,
                "async admissions changed the")


def test_a_lost_step_that_drops_its_plan_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Historical (found by review, session 27): a step that failed while it was built never ran its plan's moves.
    Planted where a lost step's plan runs now (`lost_steps.settle_the_plan` asks the runner): it runs nothing."""
    from prism.engine.runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "run_plan_of_a_lost_step", lambda self, plan: None)
    _spec_fails(spec_failed_steps.spec_a_failed_step_leaves_the_other_requests_kv_intact, "lost its KV")


def test_a_plan_marked_run_as_it_begins_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Historical (found by review, session 31): a plan was marked run before its first move, so a step whose swap-ins
    ran and whose swap-outs raised was settled as if its plan had run. Planted: a plan that raises is counted whole."""
    from prism.engine import runner
    from prism.kv.transfers import EXECUTION_ORDER

    execute = runner.execute_plan

    def counted_whole_when_it_raises(plan, gpu, cpu):
        try:
            execute(plan, gpu, cpu)
        except Exception:
            plan.stages_run = len(EXECUTION_ORDER)
            raise

    monkeypatch.setattr(runner, "execute_plan", counted_whole_when_it_raises)
    _spec_fails(spec_failed_steps.spec_a_failed_step_leaves_the_other_requests_kv_intact, "lost its KV")


def test_moves_failing_again_that_fail_no_request_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 32): moves of a lost step that failed again when settled left the requests whose pages
    they write live on pages that never received their KV (then, the failure escaped `Engine.step`). Planted: no
    request is found to fail."""
    from prism.engine import lost_steps

    monkeypatch.setattr(lost_steps, "requests_the_unrun_moves_write", lambda engine, plan: [])
    _spec_fails(spec_failed_steps.spec_a_failed_step_leaves_the_other_requests_kv_intact, "lost its KV")


def test_alternatives_counted_for_the_batch_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 27): a row's logprobs carried as many alternatives as the most demanding row of its
    batch asked for (`logprobs=2` beside `logprobs=7` answered 7; `logprobs=0`, none asked, got 7 too). Planted: the
    row's own count ignored again."""
    from prism.engine import sampler
    from specs import spec_sampling_companions

    fixed = sampler.token_logprobs
    monkeypatch.setattr(sampler, "token_logprobs",
                        lambda result, row, token, alternatives: fixed(result, row, token, result.top_token_ids.shape[1]))
    _spec_fails(spec_sampling_companions.spec_a_row_samples_as_it_would_alone, "alternatives")


def test_a_call_keeping_only_its_own_events_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 27): each `LLM` call stepped the shared engine and kept only its own requests'
    events, so a `generate` run while a stream was open took the stream's last events (the stream then stepped an
    empty engine for ever) and two streams read in turn each lost tokens. Planted: a step's events for requests
    other than the caller's are dropped again."""
    from prism.engine.llm import LLM
    from specs import spec_llm_event_routing

    def keep_own(self, request_ids):
        for event in self.engine.step():
            if event.request_id in request_ids:
                self._mailboxes[event.request_id].append(event)

    monkeypatch.setattr(LLM, "_step_for", keep_own)
    try:
        _spec_fails(spec_llm_event_routing.spec_each_call_gets_all_of_its_own_events, "read|will never get")
    finally:
        spec_llm_event_routing.engine_under_test.cache_clear()  # a planted run leaves requests behind


def test_an_event_routing_example_after_one_that_leaked_is_not_shared_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The event routing spec's examples share an engine: a request or sequence one left for good (the leak its check
    is for) would fail every later one's check, and Hypothesis would shrink to an example that fails only after
    another. Planted: the engine shared whatever it holds."""
    from specs import spec_llm_event_routing

    spec = spec_llm_event_routing.spec_each_call_gets_all_of_its_own_events
    _the_next_example_fails_for_what_one_left(
        monkeypatch, spec, dict(ops=[("open", "Hi", 2)]), "sequences leak", "left behind")


def test_a_stop_string_example_after_one_that_leaked_is_not_shared_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop string spec's examples share an engine: a request or sequence one left for good would fail every later
    one's check that nothing is left behind. Planted: the engine shared whatever it holds."""
    from specs import spec_stop_at_flush

    tokens = spec_stop_at_flush.engine_under_test().engine.inputs.tokenizer.encode("ab k.").ids
    spec = spec_stop_at_flush.spec_a_stop_string_ends_the_request_wherever_it_completes
    _the_next_example_fails_for_what_one_left(
        monkeypatch, spec, dict(script=(tokens, len(tokens), ("zzz",))), "sequences leak", "left behind")


def test_a_stop_string_completed_by_the_last_flush_left_as_length_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose token budget ended it inside a character, the flushed U+FFFD completing a stop string (or one
    whose held-back last characters completed it), was cut before the string but ended with "length". Planted: the
    engine releases the flushed text and keeps the budget's reason again."""
    from prism.engine.engine import Engine
    from specs import spec_stop_at_flush

    monkeypatch.setattr(Engine, "_last_text", lambda self, request, reason: (
        self._streams[request.request_id].flush(), reason))
    _spec_fails(spec_stop_at_flush.spec_a_stop_string_ends_the_request_wherever_it_completes, "ended with")


def test_an_unchecked_config_value_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found (session 29): `device`, the cache sizes and `model_id` were not checked, so a bad value passed the
    config and broke the engine's start after the model had loaded. Planted: `device` unchecked again."""
    from prism.engine import config
    from specs import spec_engine_config

    monkeypatch.setattr(config, "_DEVICE", re.compile(r".*", re.DOTALL))
    _spec_fails(spec_engine_config.spec_a_config_value_is_refused_naming_its_key_or_serves,
                "passed the config checks")


def test_a_detokenizer_decoding_its_pending_run_again_at_each_token_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the review of the streamed text: the detokenizer decoded a window of tokens from its last clean
    boundary at each token, and held the window while its text ended in U+FFFD, so a run of tokens that never ends a
    character (lone continuation bytes, lead bytes each cutting the one before) was decoded again whole at every token:
    quadratic work. Planted: that windowed detokenizer."""
    from prism.engine.detokenize import IncrementalDetokenizer
    from specs import spec_detokenizer_work

    def windowed_init(self, tokenizer, prompt_token_ids=(), skip_special_tokens=True):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids, self._prefix_offset, self._read_offset = [], 0, 0
        self._prefix_text, self._finished, self._num_generated, self.text = "", False, 0, ""

    def decode(self, start, end):
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def windowed_add(self, token_id):
        self._ids.append(token_id)
        new_text = decode(self, self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = decode(self, self._prefix_offset, self._read_offset)
        self.text += delta
        return delta

    def windowed_flush(self):
        delta = decode(self, self._prefix_offset, len(self._ids))[len(self._prefix_text) :]
        self.text += delta
        return delta

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", windowed_init)
    monkeypatch.setattr(IncrementalDetokenizer, "add", windowed_add)
    monkeypatch.setattr(IncrementalDetokenizer, "flush", windowed_flush)
    _spec_fails(spec_detokenizer_work.spec_the_detokenizers_work_is_linear_in_the_tokens, "units of work")


def test_a_decoder_holding_a_surrogates_start_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the review of session 33: Python's incremental UTF-8 decoder, used as is, holds ED A0..BF as an
    incomplete character, which Unicode's rule (and `tokenizers`) calls invalid. Planted: that decoder again."""
    import codecs

    from prism.engine import detokenize
    from specs import spec_lossy_utf8

    class PythonsOwn:
        def __init__(self, held: bytes = b"") -> None:
            self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
            self._decoder.setstate((held, 0))

        def decode(self, data: bytes, final: bool = False) -> str:
            return self._decoder.decode(data, final)

        @property
        def held(self) -> bytes:
            return self._decoder.getstate()[0]

    monkeypatch.setattr(detokenize, "Utf8Decoder", PythonsOwn)
    _spec_fails(spec_lossy_utf8.spec_pieces_decode_as_the_whole_and_hold_only_completable_starts, "no bytes complete")
    _spec_fails(spec_lossy_utf8.spec_every_two_byte_start_is_held_only_if_completable, "no bytes complete")
