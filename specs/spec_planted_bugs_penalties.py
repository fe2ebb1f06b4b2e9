"""Proof that the logit adjustments' specs bite (`specs/spec_sampling_penalties.py`, `specs/spec_penalty_counts.py`):
plausible bugs of the penalties and of their count table, planted. Each test monkeypatches one buggy variant into the
real sampler, table or engine and requires the spec to fail (see `specs/planted.py`).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from prism.engine import penalties, penalty_counts, sampler
from prism.engine.penalties import TokenHistory
from prism.engine.penalty_counts import PenaltyTableFull
from prism.engine.request import Request, RequestState
from specs import spec_penalty_counts, spec_sampling_penalties
from specs.planted import _spec_fails, _the_next_example_fails_for_what_one_left


def _plant_histories(monkeypatch: pytest.MonkeyPatch, change) -> None:
    """The adjusting rows' histories as `change(histories)` makes them, where the count table is built."""
    of = penalties._Plan.of.__func__

    def planted(cls, params, histories, vocab):
        return of(cls, params, change(list(histories)), vocab)

    monkeypatch.setattr(penalties._Plan, "of", classmethod(planted))


def test_counts_from_the_wrong_row_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each adjusting row scattered its neighbour's history into its line of the count table."""
    _plant_histories(monkeypatch, lambda hs: hs[1:] + hs[:1])
    _spec_fails(spec_sampling_penalties.spec_a_row_is_adjusted_from_its_own_history_only, "alone|adjusted logits")


def test_presence_and_frequency_over_the_prompt_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frequency and presence penalties counted the prompt's tokens (only the repetition penalty reads them)."""
    _plant_histories(monkeypatch, lambda hs: [h if h is None else TokenHistory(h.prompt, [*h.prompt, *h.output])
                                              for h in hs])
    _spec_fails(spec_sampling_penalties.spec_a_row_is_adjusted_from_its_own_history_only, "adjusted logits")


def test_logprobs_of_the_penalized_logits_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported logprobs were the log-softmax of the adjusted logits, not of the raw ones."""
    adjusted: list[torch.Tensor] = []
    adjusted_logits = sampler.adjusted_logits

    def keeping(x, params, histories, table=None):
        adjusted.append(adjusted_logits(x, params, histories, table))
        return adjusted[-1]

    class TorchOnTheAdjusted:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def log_softmax(x, dim):
            return torch.log_softmax(adjusted[-1], dim=dim)

    monkeypatch.setattr(sampler, "adjusted_logits", keeping)
    monkeypatch.setattr(sampler, "torch", TorchOnTheAdjusted())
    _spec_fails(spec_sampling_penalties.spec_a_row_is_adjusted_from_its_own_history_only, "raw logits")


def test_a_history_taken_at_launch_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async scheduling: the penalty inputs were taken when a step was launched, before the host read the step in
    flight, so the history missed that step's token (in flight then, appended before the launched step samples)."""
    from prism.engine.runner import ModelRunner

    at_launch: dict[str, list[int]] = {}

    def recording(method):
        def launch(self, slices, *args, **kwargs):
            chunk = kwargs.get("chunk")
            for s in [*slices, *([chunk] if chunk is not None else [])]:
                at_launch[s.request.request_id] = list(s.request.output_token_ids)
            return method(self, slices, *args, **kwargs)
        return launch

    monkeypatch.setattr(ModelRunner, "execute", recording(ModelRunner.execute))
    monkeypatch.setattr(ModelRunner, "execute_decode_rows", recording(ModelRunner.execute_decode_rows))
    token_history = Request.token_history
    monkeypatch.setattr(Request, "token_history", lambda self: TokenHistory(
        token_history(self).prompt, at_launch.get(self.request_id, self.output_token_ids)))
    spec_sampling_penalties.engine.cache_clear()
    try:
        _spec_fails(spec_sampling_penalties.spec_async_scheduling_samples_on_the_whole_history,
                    "async scheduling changed the tokens")
    finally:
        spec_sampling_penalties.engine.cache_clear()


# -- the count table ---------------------------------------------------------------------------------------------------
def _table_machine_fails(match: str) -> None:
    planted = settings(spec_penalty_counts.STEPS, phases=[Phase.generate], report_multiple_bugs=False, database=None,
                       derandomize=True)
    with pytest.raises(AssertionError, match=match):
        spec_penalty_counts.tour()  # every slot's life, in a fixed order
        run_state_machine_as_test(spec_penalty_counts.PenaltyCountsMachine, settings=planted)


def test_new_tokens_counted_twice_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step scattered a slot's new tokens but did not record them as counted: the next step counts them again."""

    def commit_forgetting_counted(self) -> None:
        for slot in self.prompt_slots:
            slot.prompt_filled = True

    monkeypatch.setattr(penalty_counts._Update, "commit", commit_forgetting_counted)
    _table_machine_fails("recount as|from its whole history")


def test_a_reused_slot_not_zeroed_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A released row was given to the next request with its last owner's counts."""
    monkeypatch.setattr(penalty_counts.PenaltyCounts, "_zero", lambda self, rows: None)
    _table_machine_fails("recount as|from its whole history|prompt plane")


def test_a_slot_kept_after_its_request_ends_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that ended kept its row (the release forgotten): the table fills with rows nobody reads."""
    monkeypatch.setattr(penalty_counts.CountsSlot, "release", lambda self: None)
    _table_machine_fails("a slot leaked|while not running")  # whichever the machine meets first


def _plant_slots_kept_while_preempted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot went back only when its request finished, as before the table was bounded: a preempted request kept
    it while it waited."""
    transition = Request.transition

    def keeping_the_slot(self, new):
        slot = self._penalty_counts
        if new is RequestState.FINISHED or slot is None:
            return transition(self, new)
        self._penalty_counts = None
        try:
            transition(self, new)
        finally:
            self._penalty_counts = slot

    monkeypatch.setattr(Request, "transition", keeping_the_slot)


def _plant_a_released_slot_still_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The release gave the row back to the table, but the handle kept it and its count mark: resumed, the request
    went on adding its new tokens to a row the table had given (zeroed) to another, instead of taking a fresh one
    refilled from its whole history."""

    def give_back_only(self) -> None:
        if self._give_back is not None:
            self._give_back()

    monkeypatch.setattr(penalty_counts.CountsSlot, "release", give_back_only)


def test_a_slot_kept_while_preempted_is_caught_by_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    _plant_slots_kept_while_preempted(monkeypatch)
    _table_machine_fails("while not running")


def test_a_released_slot_not_refilled_is_caught_by_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    _plant_a_released_slot_still_used(monkeypatch)
    _table_machine_fails("while not running|recount as|from its whole history")


def _engine_spec_fails(spec, match: str, errors=AssertionError) -> None:
    spec_penalty_counts.engine.cache_clear()  # engines left mid-run by the planted bug are not reused
    try:
        _spec_fails(spec, match, errors)
    finally:
        spec_penalty_counts.engine.cache_clear()


def test_a_slot_kept_while_preempted_is_caught_on_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Preempted requests wait beside those that run (a younger one ran ahead of an older one waiting for a shared
    prefill): the slots held outnumber max_num_seqs, and the table of max_num_seqs slots runs out."""
    _plant_slots_kept_while_preempted(monkeypatch)
    _engine_spec_fails(spec_penalty_counts.spec_only_running_requests_hold_slots,
                       "a slot held by a request not running|slots of the penalty count table",
                       (AssertionError, PenaltyTableFull))


def test_a_released_slot_not_refilled_is_caught_on_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    _plant_a_released_slot_still_used(monkeypatch)
    _engine_spec_fails(spec_penalty_counts.spec_a_preempted_request_samples_as_undisturbed,
                       "in a pool that preempted it")


def test_a_preempted_sampling_example_after_a_failed_one_is_not_shared_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine specs of the count table share their engines: the requests of an example that failed mid-run ran
    beside the next one's, their events taken for those of its requests of the same index. Planted: the engine shared
    whatever it holds."""
    scenario = ("recompute", False, [(0, 24, spec_penalty_counts.PENALTIES[0], 0),
                                     (1, 24, spec_penalty_counts.PENALTIES[3], 1)])
    spec = spec_penalty_counts.spec_a_preempted_request_samples_as_undisturbed
    _the_next_example_fails_for_what_one_left(monkeypatch, spec, dict(scenario=scenario), "a step fails", "request 0 ")
