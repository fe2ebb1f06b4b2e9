"""Proof that the decisions' specs bite: each historical bug of a decision's material and forks, its liveness, its
unforked questions and the thinking re-read, planted.

Each test monkeypatches one buggy variant into the real engine and requires the spec that owns the invariant to fail
(see `specs/planted.py`).
"""

from __future__ import annotations

import pytest

from prism.engine.engine import RequestError
from prism.kv.manager import KVCacheManager, SequenceError
from specs import spec_decision_material
from specs.planted import _spec_fails, _the_next_example_fails_for_what_one_left


def test_a_material_of_common_token_ids_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Historical (session 27's review): a decision's material was its branches' common token ids, equal pad tokens
    of different pictures included."""
    import os

    from prism.engine import decision_forks

    def common_token_ids(branches):
        prompts = [b.prompt.token_ids for b in branches]
        return min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)

    monkeypatch.setattr(decision_forks, "material_length", common_token_ids)  # looked up there
    # SequenceError: the KV manager's own guard (a fork's content must begin with its material's) caught it.
    _spec_fails(spec_decision_material.spec_each_question_reads_what_it_reads_alone,
                "another picture|does not begin with", (AssertionError, SequenceError))


def test_a_fork_without_the_questions_own_media_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A question forked with its tokens appended but not its own picture's media span (session 28's first cut)."""
    fork = KVCacheManager.fork

    def fork_without_own_media(self, seq_id, child_id, content=None):
        child = fork(self, seq_id, child_id)
        if content is not None:
            child.content.tokens.extend(content.tokens[len(child.content):])
        return child

    monkeypatch.setattr(KVCacheManager, "fork", fork_without_own_media)
    _spec_fails(spec_decision_material.spec_each_question_reads_what_it_reads_alone, "names other media")


def test_branches_forked_without_the_prompt_checks_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 22): `Engine.add_decision` checked only the material; a question's branch past
    max_model_len was forked anyway and waited for ever for pages (or, with a larger pool, was answered past the
    model's length). Planted: the branch prompts go unchecked again."""
    from prism.engine.engine import Engine
    from specs import spec_decision_liveness

    check = Engine._check_prompt

    def materials_only(self, prompt, what="the prompt"):
        if what == "the prompt":  # add_request's own check; a branch's names its request
            check(self, prompt, what)

    monkeypatch.setattr(Engine, "_check_prompt", materials_only)
    spec_decision_liveness.engine_under_test.cache_clear()  # a fresh engine: a planted run leaves one stuck
    try:
        _spec_fails(spec_decision_liveness.spec_every_decide_is_answered_or_refused_before_it_runs,
                    "not answered after|past max_model_len")
    finally:
        spec_decision_liveness.engine_under_test.cache_clear()


def test_branch_copying_a_tail_only_the_cache_shares_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the decision liveness spec (session 23): a branch as long as the pool copied the material's partly
    filled tail page, which only cache entries still held, and so needed one page more than the pool: it waited for
    ever. Planted: no cache entry ever gives a tail up to a sequence."""
    from prism.kv.manager import KVCacheManager
    from specs import spec_decision_liveness

    monkeypatch.setattr(KVCacheManager, "_held_otherwise_only_as_cached_tail", lambda self, page: False)
    spec_decision_liveness.engine_under_test.cache_clear()
    try:
        _spec_fails(spec_decision_liveness.spec_every_decide_is_answered_or_refused_before_it_runs, "not answered after")
    finally:
        spec_decision_liveness.engine_under_test.cache_clear()


def test_questions_left_without_an_ending_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 27): a decision's questions existed only in its material until it was computed, so a
    material that ended otherwise (a client leaving, a failed step) left them without a terminal event, and an abort
    of one did nothing. Planted: a question that is never forked gets no event again."""
    from prism.engine.engine import Engine
    from specs import spec_unforked_questions

    monkeypatch.setattr(Engine, "_end_question",
                        lambda self, branch, material, reason, error=None: self._unspawned.pop(branch.request_id))
    try:
        _spec_fails(spec_unforked_questions.spec_every_question_ends_once, "terminal events")
    finally:
        spec_unforked_questions.engine_under_test.cache_clear()


def test_a_reread_of_the_whole_generation_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 27): the re-read appended a reasoning generation's tokens as they were, its
    end-of-turn token or the stop string "Final answer:" included. Planted: the generation shown whole again."""
    from prism.decision import thinking
    from specs import spec_thinking_reread

    monkeypatch.setattr(thinking, "reasoning_of", lambda thought, decode, end_token_ids: list(thought))
    _spec_fails(spec_thinking_reread.spec_the_reread_shows_the_reasoning_once, "end-of-turn|cue")


def test_a_failed_reasoning_answered_as_thought_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 33): a reasoning generation the engine failed was re-read as it stood, cut short, and
    the question answered as if it had thought. Planted: the generation's tokens taken whatever its end."""
    from prism.decision import plan
    from specs import spec_decision_liveness

    monkeypatch.setattr(plan, "reasoning_tokens", lambda outcome, index: list(outcome.token_ids or ()))
    _spec_fails(spec_decision_liveness.spec_a_decide_whose_work_fails_is_never_answered, "answered .* although")


def test_a_reread_cue_ending_in_a_space_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 33): the re-read's answer cue ended with a space, with Qwen's tokenizer a token of its
    own, after which "Yes" or "A" was read where the text "answer: Yes" has the one token " Yes". Planted: that cue."""
    from prism.decision import thinking
    from specs import spec_thinking_reread

    monkeypatch.setattr(thinking, "ANSWER_CUE", "\nFinal answer: ")
    _spec_fails(spec_thinking_reread.spec_each_answer_is_read_where_the_tokenizer_puts_it, "the re-read reads")


def test_a_readout_without_its_temperature_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plausible: a branch read at temperature 1 whatever its question asked (the temperature lost on the way from
    the question to the engine's readout). Planted: the engine's readout ignores it."""
    from prism.decision.questions import readout
    from prism.engine import engine

    monkeypatch.setattr(engine, "readout", lambda logits, candidates, temperature=1.0: readout(logits, candidates))
    _spec_fails(spec_decision_material.spec_each_answer_is_the_reference_softmax, "against the reference")


def test_a_grouped_choice_checked_for_other_winners_than_its_longest_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 33): a grouped choice's final round was built, and refused, only after its groups ran.
    Planted: the up-front check made on one final round that is not the longest (each group's first option), so that
    a longer one is still refused late."""
    from prism.decision import plan
    from prism.decision.questions import Question
    from specs import spec_decision_liveness

    monkeypatch.setattr(plan, "longest_final", lambda question, encode: Question(
        "choice", question.text, tuple(g.options[0] for g in plan.grouped(question)), temperature=question.temperature))
    _spec_fails(spec_decision_liveness.spec_a_grouped_choice_is_refused_up_front_or_its_final_round_fits,
                "refused after the groups ran")


def test_usage_of_one_request_per_question_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 33): a question's usage was one engine request's (a grouped choice's final round, a
    thinking question's first readout). Planted: only a question's last request counted."""
    from prism.decision import plan
    from specs import spec_decision_usage

    usage_of = plan.usage_of
    monkeypatch.setattr(plan, "usage_of", lambda spent: usage_of(spent[-1:]))
    _spec_fails(spec_decision_usage.spec_each_answer_counts_every_request_of_its_question, "its engine requests used")


def test_a_reasoning_seed_of_the_engines_history_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plausible (what `question_seed` exists against): a reasoning seeded by what ran before it, not by its question.
    Planted: the seed counts the reasoning generations asked so far."""
    import itertools

    from prism.decision import thinking
    from specs import spec_decision_thinking

    asked = itertools.count()
    monkeypatch.setattr(thinking, "question_seed", lambda config, question: next(asked))
    spec_decision_thinking.alone.cache_clear()  # answers computed with the planted seed only
    try:
        _spec_fails(spec_decision_thinking.spec_a_thinking_answer_is_the_questions_own, "where alone it answers")
    finally:
        spec_decision_thinking.alone.cache_clear()


def test_numpy_integer_levels_refused_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 33): score levels of numpy's integer types were refused. Planted: Python's int only."""
    from prism.decision import questions
    from specs import spec_decision_questions

    monkeypatch.setattr(questions, "integral", lambda x: isinstance(x, int) and not isinstance(x, bool))
    _spec_fails(spec_decision_questions.spec_score_levels_are_any_integers, "score levels must be integers",
                questions.QuestionError)


def test_levels_in_an_array_refused_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (session 34): `levels=np.arange(1, 6)` or `range(1, 6)` was refused as not a list. Planted: lists
    and tuples only."""
    from prism.decision import questions
    from specs import spec_decision_questions

    def lists_only(name, value):
        if not isinstance(value, (list, tuple)):
            raise questions.QuestionError(f"{name} must be a list, got {type(value).__name__}")
        return tuple(value)

    monkeypatch.setattr(questions, "listed_values", lists_only)
    _spec_fails(spec_decision_questions.spec_options_and_levels_come_in_any_ordered_container, "must be a list",
                questions.QuestionError)


def test_options_only_in_lists_ranges_and_arrays_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by session 34's review of the fix above: options and levels were taken from a list, a tuple, a range or
    anything with `ndim == 1` and `tolist`, so a deque or an `array.array` was refused and a memoryview of bytes was
    taken for byte-valued levels (bytes themselves refused). Planted: that rule again."""
    from prism.decision import questions
    from specs import spec_decision_questions

    def lists_ranges_and_arrays(name, value):
        if isinstance(value, (list, tuple, range)):
            return tuple(value)
        if getattr(value, "ndim", None) == 1 and callable(getattr(value, "tolist", None)):
            return tuple(value.tolist())
        raise questions.QuestionError(f"{name} must be a list (or a one-dimensional array), got {type(value).__name__}")

    monkeypatch.setattr(questions, "listed_values", lists_ranges_and_arrays)
    _spec_fails(spec_decision_questions.spec_options_and_levels_come_in_any_ordered_container,
                "must be a list", questions.QuestionError)


# -- engines shared by the examples: each example gets one that holds nothing of another (`shared_engines`) ------------
def test_a_liveness_example_after_a_failed_one_is_not_shared_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The liveness spec's decides are named spec/material, spec/q0, ... in every example, on one shared engine: an
    example that failed with its requests in the engine made the next one's decide refused as in use, reported as a
    refusal of prompts that fit. Planted: the engine shared whatever it holds."""
    from specs import spec_decision_liveness

    spec = spec_decision_liveness.spec_every_decide_is_answered_or_refused_before_it_runs
    _the_next_example_fails_for_what_one_left(monkeypatch, spec, dict(padding=[0]), "a step fails", "already in use")


def test_a_failing_work_example_after_one_that_leaked_is_not_shared_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The failing-work liveness spec's examples share an engine: work one left for good (the leak its last check is
    for) would fail every later one's check. Planted: the engine shared whatever it holds."""
    from specs import spec_decision_liveness

    spec = spec_decision_liveness.spec_a_decide_whose_work_fails_is_never_answered
    _the_next_example_fails_for_what_one_left(
        monkeypatch, spec, dict(picks=[0], stage="readout", which=0), "sequences leak", "left work behind")


def test_a_thinking_example_after_one_that_leaked_is_not_shared_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thinking spec's examples share an engine: requests or sequences one left for good would fail every later
    one's last check. Planted: the engine shared whatever it holds."""
    from specs import spec_decision_thinking

    spec = spec_decision_thinking.spec_a_thinking_answer_is_the_questions_own
    _the_next_example_fails_for_what_one_left(
        monkeypatch, spec, dict(picks=[0], gate=0.0, warm=False, seed=0), "sequences leak",
        "left requests or sequences behind")


def test_a_reference_softmax_example_after_one_that_leaked_is_not_shared_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference softmax spec's examples share an engine: a sequence one left for good would fail every later one's
    check that a decide leaves none. Planted: the engine shared whatever it holds."""
    spec = spec_decision_material.spec_each_answer_is_the_reference_softmax
    _the_next_example_fails_for_what_one_left(
        monkeypatch, spec, dict(picks=[1], twice=False), "sequences leak", "left a sequence or a request")


def test_a_usage_example_after_a_failed_one_is_not_shared_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The usage spec's examples share an engine: a decide that failed (its requests aborted) left their terminal events
    unread, and the next example's first step gave them out, counted as its own questions' usage. Planted: the engine
    shared whatever it holds."""
    from specs import spec_decision_usage

    spec = spec_decision_usage.spec_each_answer_counts_every_request_of_its_question
    _the_next_example_fails_for_what_one_left(
        monkeypatch, spec, dict(picks=[0], gate=None, warm=False, seed=0), "a step fails", "its engine requests used")


def test_an_unforked_questions_example_after_a_failed_one_is_not_shared_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unforked questions spec's examples share an engine and name their decide d<serial>, which Hypothesis shrinks
    to d0: an example that failed with its decide in the engine had the next one's refused as in use. Planted: the
    engine shared whatever it holds."""
    from specs import spec_unforked_questions

    spec = spec_unforked_questions.spec_every_question_ends_once
    _the_next_example_fails_for_what_one_left(
        monkeypatch, spec, dict(questions=2, ending="material fails", at_step=3, which=0, serial=0), "a step fails",
        "already in use", RequestError)
