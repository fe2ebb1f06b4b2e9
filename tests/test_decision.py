"""Decision requests on the tiny checkpoint (CPU, fp32 weights and KV): each branch forked from the
material reads the same probabilities as its question sent alone as a full prompt; siblings change
nothing; the vision encoder runs once per decide; a second decide over the material is a full hit."""

from __future__ import annotations

import pytest
import torch

from prism.decision.questions import Question, QuestionError, candidate_token_ids, make_answer, readout
from prism.engine.engine import RequestError
from prism.engine.llm import LLM
from prism.engine.request import Branch
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images

IMAGES = random_images([(64, 64), (64, 96)], seed=2)
MATERIAL = [{"role": "user", "content": [{"type": "image", "image": IMAGES[0]}, {"type": "image", "image": IMAGES[1]},
                                         {"type": "text", "text": "Look at these two pictures carefully."}]}]
QUESTIONS = [
    Question("choice", "Which picture is larger?", ("the first", "the second", "they are the same size")),
    Question("yes_no", "Is either picture mostly dark?"),
    Question("score", "How colourful are they?", levels=(1, 2, 3, 4, 5)),
    Question("choice", "What do they show?", ("noise", "a cat", "a dog", "a chart")),
]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def new_llm(**overrides) -> LLM:
    return LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=4, num_gpu_pages=256, check_invariants=True,
               **overrides)


def alone(llm: LLM, question: Question) -> list[float]:
    """The same question as one full prompt, read out at its last position (no branch, no cache)."""
    prompt = llm.engine.inputs.prepare_chat([*MATERIAL, {"role": "user", "content": question.render()}])
    candidates = candidate_token_ids(question, llm.engine.inputs.encode)
    llm.engine.add_readout_request("alone", prompt, candidates, question.temperature)
    while True:
        for event in llm.engine.step():
            if event.finished and event.request_id == "alone":
                return event.readout


def test_each_branch_equals_its_question_alone():
    reference = new_llm(enable_prefix_cache=False)
    expected = [alone(reference, q) for q in QUESTIONS]
    llm = new_llm()
    answers = llm.decide(MATERIAL, QUESTIONS)
    for question, answer, probs in zip(QUESTIONS, answers, expected, strict=True):
        got = [answer.probabilities[label] for label in question.labels]
        assert max(abs(a - b) for a, b in zip(got, probs, strict=True)) <= 1e-5, (question.text, got, probs)
        assert answer.answer == question.labels[max(range(len(probs)), key=probs.__getitem__)]
        assert abs(sum(got) - 1) < 1e-5
    assert not llm.engine.kv.seqs


def test_siblings_change_no_answer():
    full = {q.text: a.probabilities for q, a in zip(QUESTIONS, new_llm().decide(MATERIAL, QUESTIONS), strict=True)}
    for subset in (QUESTIONS[::-1], QUESTIONS[1:3], [QUESTIONS[2]], [QUESTIONS[0], QUESTIONS[0]]):
        for q, a in zip(subset, new_llm().decide(MATERIAL, subset), strict=True):
            for label, p in a.probabilities.items():
                assert abs(p - full[q.text][label]) <= 1e-6, (q.text, label)


def test_vision_runs_once_and_a_second_decide_is_a_full_hit():
    llm = new_llm()
    stats = llm.engine.runner.stats
    first = llm.decide(MATERIAL, QUESTIONS)
    assert stats.vision_items_encoded == 2, "the material's two images are encoded once for all questions"
    assert all(a.cached_tokens == 0 for a in first)
    second = llm.decide(MATERIAL, QUESTIONS[:2])
    assert stats.vision_items_encoded == 2, "a second decide over the same material must not run vision"
    material_tokens = len(llm.engine.inputs.prepare_chat(MATERIAL).token_ids)
    assert all(a.cached_tokens >= material_tokens - 8 for a in second)
    for a, b in zip(first[:2], second, strict=True):
        assert a.probabilities == pytest.approx(b.probabilities, abs=1e-5)
    llm.engine.kv.clear_cache()
    assert llm.engine.kv.gpu.num_free == llm.engine.kv.gpu.num_pages


def test_question_validation_and_single_token_candidates():
    with pytest.raises(QuestionError, match="at least two options"):
        Question("choice", "Pick", ("only",))
    with pytest.raises(QuestionError, match="distinct levels"):
        Question("score", "Rate", levels=(3, 3))
    with pytest.raises(QuestionError, match="kind"):
        Question("essay", "Write")  # type: ignore[arg-type]
    with pytest.raises(QuestionError, match="2 tokens"):
        candidate_token_ids(Question("score", "Rate", levels=(1, 10)), lambda text: [ord(c) for c in text])
    # session 27's review: each of these was accepted, or failed later with another error type
    for bad, match in ((dict(kind="yes_no", text=None), "needs text"),
                       (dict(kind="choice", text="Pick", options="ab"), "options must be a list"),
                       (dict(kind="choice", text="Pick", options=("a", 2)), "non-empty strings"),
                       (dict(kind="score", text="Rate", levels=["a", "b"]), "integers"),
                       (dict(kind="score", text="Rate", levels=[1.5, 2]), "integers"),
                       (dict(kind="yes_no", text="Rain?", temperature=True), "temperature")):
        with pytest.raises(QuestionError, match=match):
            Question(**bad)
    with pytest.raises(QuestionError, match="at least one question"):
        new_llm().decide(MATERIAL, [])


def test_readout_is_a_softmax_over_candidates_only():
    logits = torch.tensor([0.0, 2.0, 1.0, 50.0])  # token 3 dominates the vocabulary but is not a candidate
    probs = readout(logits, [1, 2])
    assert probs == pytest.approx(torch.softmax(torch.tensor([2.0, 1.0]), 0).tolist())
    assert readout(logits, [1, 2], temperature=2.0) == pytest.approx(torch.softmax(torch.tensor([1.0, 0.5]), 0).tolist())
    answer = make_answer(0, Question("score", "Rate", levels=(1, 2)), [0.25, 0.75])
    assert answer.answer == "2" and answer.expected_value == pytest.approx(1.75)


@pytest.mark.parametrize("temperature", [1e-3, 1e-40, 1e-45, 5e-324])
def test_readout_at_a_tiny_temperature_is_the_argmax_not_nan(temperature):
    """A positive temperature however small (the API accepts any > 0): the best candidate gets everything, ties
    share it, nothing is NaN (dividing first sent the logits to inf, and softmax made inf - inf)."""
    logits = torch.tensor([0.0, 2.0, 1.0, 50.0], dtype=torch.bfloat16)
    assert readout(logits, [1, 2], temperature) == [1.0, 0.0]
    assert readout(torch.tensor([3.0, 3.0, -1.0]), [0, 1, 2], temperature) == [0.5, 0.5, 0.0]


def test_gated_thinking_thinks_only_below_the_gate_and_ignores_siblings():
    from prism.decision.thinking import ThinkingConfig

    never = new_llm().decide(MATERIAL, QUESTIONS, ThinkingConfig(gate=0.0))
    plain = new_llm().decide(MATERIAL, QUESTIONS)
    assert not any(a.thought for a in never)
    assert [a.probabilities for a in never] == [a.probabilities for a in plain]

    always = ThinkingConfig(gate=1.0, max_tokens=12, seed=3)
    together = new_llm(deterministic=True).decide(MATERIAL, QUESTIONS, always)
    assert all(a.thought and 0 < a.thinking_tokens <= 12 for a in together)
    assert all(abs(sum(a.probabilities.values()) - 1) < 1e-5 for a in together)
    # The same question alone (no siblings, other batch companions): in deterministic mode, where the logits do not
    # depend on the batch, the same reasoning and answer (elsewhere only its seed is the same: thinking.py).
    alone_answer = new_llm(deterministic=True).decide(MATERIAL, [QUESTIONS[2]], always)[0]
    assert alone_answer.thinking_tokens == together[2].thinking_tokens
    assert alone_answer.probabilities == together[2].probabilities


def test_more_than_26_options_go_through_grouped_rounds():
    options = tuple(f"option number {k}" for k in range(30))
    question = Question("choice", "Which option fits best?", options)
    assert question.labels[:3] == ("1", "2", "3") and len(question.labels) == 30
    llm = new_llm()
    (answer,) = llm.decide(MATERIAL, [question])
    assert set(answer.probabilities) == set(question.labels)
    assert abs(sum(answer.probabilities.values()) - 1) < 1e-5
    nonzero = [label for label, p in answer.probabilities.items() if p > 0]
    assert len(nonzero) == 2, "two groups (15 + 15): the final round is between their two winners"
    assert answer.answer in nonzero and answer.confidence == max(answer.probabilities.values())
    assert llm.engine.runner.stats.vision_items_encoded == 2


LONG = Question("yes_no", "Is it " + "very " * 40 + "dark?")  # ~110 tokens past the material's 163


def test_a_branch_past_max_model_len_is_refused_before_anything_runs():
    """Every branch prompt is checked as a request's prompt is (here one is 304 tokens against a max_model_len of
    256): the decide is refused with nothing left behind, where the branch used to be forked unchecked and then
    wait for ever for pages no pool of that length could give it, holding the engine."""
    from prism.engine.chat import InputError
    from prism.engine.engine import RequestError

    llm = new_llm(max_model_len=256)
    # (the input processor now refuses it while the branch prompt is prepared, the engine's check behind it)
    with pytest.raises((InputError, RequestError), match="304 tokens.*max_model_len.*256"):
        llm.decide(MATERIAL, [QUESTIONS[1], LONG])
    assert not llm.engine.requests and not llm.engine.kv.seqs and not llm.engine.has_unfinished_requests()
    (answer,) = llm.decide(MATERIAL, [QUESTIONS[1]])  # the engine serves on
    assert abs(sum(answer.probabilities.values()) - 1) < 1e-5


def test_reasoning_is_cut_short_so_that_its_reread_fits():
    """Gated thinking near max_model_len: the reasoning gets the tokens its re-read leaves (here at most 256 - 1 -
    the question's prompt with the preamble - the answer cue), instead of its 128 and a re-read longer than the
    engine takes; a question with no room at all keeps its first readout."""
    from prism.decision.thinking import ANSWER_CUE, THINKING_PREAMBLE, ThinkingConfig

    llm = new_llm(max_model_len=256)
    encode = llm.engine.inputs.encode
    prompt = llm.engine.inputs.prepare_chat([*MATERIAL, {"role": "user", "content": QUESTIONS[1].render()}])
    room = 256 - 1 - len(prompt.token_ids) - len(encode(THINKING_PREAMBLE)) - len(encode(ANSWER_CUE))
    (answer,) = llm.decide(MATERIAL, [QUESTIONS[1]], ThinkingConfig(gate=1.0, max_tokens=128))
    assert answer.thought and 1 <= answer.thinking_tokens <= room < 128
    tight = new_llm(max_model_len=len(prompt.token_ids) + 2)  # the prompt fits, its reasoning cannot
    (first,) = tight.decide(MATERIAL, [QUESTIONS[1]], ThinkingConfig(gate=1.0))
    assert not first.thought and abs(sum(first.probabilities.values()) - 1) < 1e-5
    # chunked prefill off: a prompt must also fit one step, so the re-read must too (a review found it could not)
    unchunked = new_llm(max_model_len=1024, max_num_batched_tokens=256, enable_chunked_prefill=False)
    (answer,) = unchunked.decide(MATERIAL, [QUESTIONS[1]], ThinkingConfig(gate=1.0, max_tokens=128))
    assert answer.thought and answer.thinking_tokens <= 256 - len(prompt.token_ids) - len(encode(THINKING_PREAMBLE)) - len(
        encode(ANSWER_CUE))


@pytest.mark.parametrize("count", [27, 52])
def test_grouped_options_are_read_by_position(count):
    """More than 26 options in even groups (27: 13 + 14, where a last group of one option used to be refused as
    no question) and the final round's probabilities mapped back by position: with every option the same text
    the distribution still sums to 1 (mapping by text sent every group winner to the first option)."""
    from prism.decision.plan import grouped

    question = Question("choice", "Which option fits best?", ("the same",) * count)
    assert [len(g.options) for g in grouped(question)] == ([13, 14] if count == 27 else [26, 26])
    (answer,) = new_llm().decide(MATERIAL, [question])
    assert abs(sum(answer.probabilities.values()) - 1) < 1e-5
    assert len([p for p in answer.probabilities.values() if p > 0]) == 2  # the two group winners


def _decides_at_once(llm: LLM, count: int) -> dict[str, list[float]]:
    """`count` decides of the first two questions over MATERIAL, all added before the first step: readouts by id."""
    inputs = llm.engine.inputs
    ids = []
    for d in range(count):
        branches = [Branch(f"d{d}/q{i}", inputs.prepare_chat([*MATERIAL, {"role": "user", "content": q.render()}]),
                           candidate_token_ids(q, inputs.encode)) for i, q in enumerate(QUESTIONS[:2])]
        ids += llm.engine.add_decision(f"d{d}", branches)
    return {i: c.readout for i, c in llm._run_until_finished(ids).items()}


def test_decides_submitted_together_compute_their_material_once():
    """The first decide's material is prefilled; the others wait for it and hit its pages (the same readouts as
    computing the material once per decide, which is what happened before)."""
    material_tokens = len(new_llm().engine.inputs.prepare_chat(MATERIAL).token_ids)
    once, each = new_llm(defer_shared_prefill_tokens=8), new_llm(defer_shared_prefill_tokens=None)
    waited, computed_each = _decides_at_once(once, 4), _decides_at_once(each, 4)
    saved = each.engine.runner.stats.tokens_computed - once.engine.runner.stats.tokens_computed
    assert saved >= 3 * (material_tokens - 8), f"only {saved} tokens saved of three more materials of {material_tokens}"
    assert once.engine.runner.stats.vision_items_encoded == 2, "the images are encoded once, for the first material"
    for request_id, probabilities in computed_each.items():
        assert waited[request_id] == pytest.approx(probabilities, abs=1e-5), request_id
    assert not once.engine.kv.seqs and not once.engine.requests


def test_the_reread_shows_the_reasoning_once_without_its_end_or_its_cue():
    """`reasoning_of` (found by review, session 27): a reasoning generation ends with the end-of-turn token or on
    the stop string "Final answer:", whose tokens it keeps; appended as they were, the re-read put the answer outside
    the assistant's turn or asked for it twice."""
    from prism.decision.thinking import ANSWER_CUE, reasoning_of

    inputs = new_llm().engine.inputs
    decode = lambda ids: inputs.decode(ids, skip_special_tokens=False)  # noqa: E731
    thought = inputs.encode("It looks wet outside, so yes.")
    eos = inputs.eos_token_ids
    assert reasoning_of(thought, decode, eos) == thought
    assert reasoning_of(thought + [eos[0]], decode, eos) == thought
    ended_on_cue = reasoning_of(thought + inputs.encode(" " + ANSWER_CUE.strip()), decode, eos)
    assert ANSWER_CUE.strip() not in decode(ended_on_cue) and ended_on_cue[: len(thought) - 1] == thought[:-1]


def test_a_thinking_reread_never_ends_its_reasoning_with_the_end_of_turn(monkeypatch):
    """The review's case: a hot reasoning (temperature 50) that ends with the end-of-turn token; its re-read must
    not read the answer after it."""
    from prism.decision import plan
    from prism.decision.thinking import ThinkingConfig

    seen = []
    real = plan.answer_after_thinking
    monkeypatch.setattr(plan, "answer_after_thinking", lambda prompt, reasoning, encode: (
        seen.append(list(reasoning)), real(prompt, reasoning, encode))[1])
    llm = new_llm()
    (answer,) = llm.decide(MATERIAL, [Question("yes_no", "Rain?")],
                           ThinkingConfig(gate=1.0, max_tokens=200, temperature=50.0, seed=2))
    assert answer.thought and seen, "the question did not think"
    assert not any(r and r[-1] in llm.engine.inputs.eos_token_ids for r in seen), "a re-read ended its reasoning with EOS"


def answers(llm: LLM, decision_id: str, branches: list[Branch]) -> dict[str, list[float]]:
    """Each branch's readout, asked as one decision, and the decision's forked material (its token count; 0 when the
    branches share none)."""
    llm.engine.add_decision(decision_id, branches)
    out, material = {}, 0
    while llm.engine.has_unfinished_requests():
        for event in llm.engine.step():
            if event.request_id.endswith("/material"):
                material = event.prompt_tokens
            elif event.finished:
                assert event.error is None, event.error
                out[event.request_id] = event.readout
    return {**out, "material tokens": material}


def alone_branch(branch: Branch) -> list[float]:
    """The readout of the same prompt as a readout request of its own, on a fresh engine (no cache)."""
    fresh = new_llm()
    fresh.engine.add_readout_request("alone", branch.prompt, branch.candidates, branch.temperature)
    while fresh.engine.has_unfinished_requests():
        for event in fresh.engine.step():
            if event.finished:
                return event.readout
    raise AssertionError("no readout")


def test_branches_over_different_pictures_of_one_size_share_no_image():
    """Review (session 27): `add_decision` found the material as the branches' common token ids, and an image's pad
    tokens are the same for any picture of its size: branches over different pictures would have read the first
    branch's image KV. The material now ends before the first image the branches do not all hold: here each
    question is answered about its own picture."""
    llm = new_llm()
    inputs = llm.engine.inputs
    q = QUESTIONS[1]
    pictures = random_images([(64, 64), (64, 64)], seed=5)
    branches = [Branch(f"pic{k}", inputs.prepare_chat([{"role": "user", "content": [
        {"type": "image", "image": pictures[k]}, {"type": "text", "text": "Look."}]}, {"role": "user", "content": q.render()}]),
        candidate_token_ids(q, inputs.encode)) for k in (0, 1)]
    assert branches[0].prompt.token_ids == branches[1].prompt.token_ids, "the setup needs two pictures of one size"
    got = answers(llm, "two-pictures", branches)
    assert got["material tokens"] <= branches[0].prompt.media[0].start
    for b in branches:
        assert got[b.request_id] == pytest.approx(alone_branch(b), abs=1e-5)
    assert got["pic0"] != pytest.approx(got["pic1"], abs=1e-3), "the two pictures should read differently"


def test_a_question_with_a_picture_of_its_own_forks_from_the_material_before_it():
    """A question may show a picture of its own after the material (here: the same size for both questions, so their
    pad tokens are equal): the material is the part before it, each question computes its picture, and its KV's
    content names that picture (so no page of it can be shared with the other question's)."""
    llm = new_llm()
    inputs = llm.engine.inputs
    q = QUESTIONS[1]
    pictures = random_images([(32, 32), (32, 32)], seed=9)
    seen_content = {}
    fork = llm.engine.kv.fork

    def recording_fork(parent, child, content=None):
        seq = fork(parent, child, content)
        seen_content[child] = [m.digest for m in seq.content.media]
        return seq

    llm.engine.kv.fork = recording_fork
    branches = [Branch(f"own{k}", inputs.prepare_chat([*MATERIAL, {"role": "user", "content": [
        {"type": "text", "text": "And this one:"}, {"type": "image", "image": pictures[k]}, {"type": "text", "text": q.render()}]}]),
        candidate_token_ids(q, inputs.encode)) for k in (0, 1)]
    got = answers(llm, "own-pictures", branches)
    own_start = branches[0].prompt.media[-1].start
    assert 0 < got["material tokens"] <= own_start, "the material is the part before the questions' own pictures"
    for b in branches:
        assert seen_content[b.request_id] == [m.digest for m in b.prompt.media], "the fork's content lacks its picture"
        assert got[b.request_id] == pytest.approx(alone_branch(b), abs=1e-5)


def test_a_decision_whose_material_id_is_taken_is_refused_before_it_binds_anything():
    """Review (session 27): the material's id was only checked when the material was added, after the branches'
    image uuids were bound; a refused decision then named its pictures anyway."""
    llm = new_llm()
    inputs = llm.engine.inputs
    named = [{"role": "user", "content": [{"type": "image", "image": IMAGES[0], "uuid": "decide-pic"},
                                          {"type": "text", "text": "Look."}]}]

    def branches(tag: str) -> list[Branch]:
        return [Branch(f"{tag}/q{i}", inputs.prepare_chat([*named, {"role": "user", "content": q.render()}],
                                                          bind_names=False), candidate_token_ids(q, inputs.encode))
                for i, q in enumerate(QUESTIONS[1:3])]

    llm.engine.add_decision("same", branches("first"))
    llm.engine.inputs.image_names._names.clear()  # as if the first decide's names were forgotten (evicted)
    with pytest.raises(RequestError, match="same/material"):
        llm.engine.add_decision("same", branches("second"))
    assert llm.engine.inputs.image_names.resolve("decide-pic") is None, "a refused decision bound its uuid"
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def test_questions_and_thinking_of_the_wrong_type_are_refused_with_what_is_accepted():
    """Review (session 28): a question given as a dict or a string, or `thinking` as a dict, failed with an
    AttributeError inside the plan; `ThinkingConfig(max_tokens="8")` with a TypeError."""
    from prism.decision.thinking import ThinkingConfig

    llm = new_llm()
    for questions, thinking, words in (
        ([{"type": "yes_no", "text": "Rain?"}], None, "question 0 is a dict"),
        (["Rain?"], None, "question 0 is a str"),
        ([QUESTIONS[1]], {"gate": 0.5}, "thinking is a dict"),
    ):
        with pytest.raises(QuestionError, match=words):
            llm.decide(MATERIAL, questions, thinking)
    for kwargs, words in (({"max_tokens": "8"}, "max_tokens"), ({"max_tokens": 64.0}, "max_tokens"), ({"gate": 2}, "gate"),
                          ({"temperature": -1}, "temperature"), ({"temperature": float("inf")}, "temperature"),
                          ({"seed": 1.5}, "seed"), ({"seed": 1.0}, "seed")):
        with pytest.raises(ValueError, match=words):
            ThinkingConfig(**kwargs)
    assert not llm.engine.requests


def test_numpy_integer_levels_are_integers():
    """Review (session 33): a score's levels taken from numpy (`list(np.arange(1, 6))`, np.int64) were refused as
    "not integers"; any integral number is a level, kept as a Python int. Bools and non-integers stay refused."""
    import numpy as np

    question = Question("score", "Rate", levels=[np.int64(1), np.int32(2), np.uint8(3)])
    assert question.levels == (1, 2, 3) and all(type(level) is int for level in question.levels)
    assert make_answer(0, question, [0.25, 0.25, 0.5]).expected_value == pytest.approx(2.25)
    for bad in ([np.float64(1.0), 2], [True, 2], [np.bool_(True), 2], [1, "2"]):
        with pytest.raises(QuestionError, match="score levels must be integers"):
            Question("score", "Rate", levels=bad)


TEXT_MATERIAL = [{"role": "user", "content": "Read this note: the lamp is on and the door is shut."}]


def _long_winners_question() -> Question:
    """27 options (groups of 13 and 14) of which the first of each group is long: each group is shorter than the final
    round when those two win it."""
    options = [f"short {k}" for k in range(27)]
    options[0], options[13] = "a " * 150 + "first", "a " * 150 + "second"
    return Question("choice", "Which fits?", tuple(options))


def test_a_grouped_choice_whose_final_round_cannot_fit_is_refused_before_anything_runs():
    """Review (session 33): a grouped choice's final round (the group winners) was only built, and so only refused,
    after its group rounds had run. When the longest final round it can reach is past the engine's prompt limit, the
    decide is refused up front, naming the question, with nothing run."""
    from prism.decision.plan import Outcome, advance, grouped, plan_decision

    question = _long_winners_question()
    probe = new_llm()
    inputs = probe.engine.inputs

    def length(q: Question) -> int:
        return len(inputs.prepare_chat([*TEXT_MATERIAL, {"role": "user", "content": q.render()}]).token_ids)

    groups = max(length(g) for g in grouped(question))
    final = length(Question("choice", question.text, (question.options[0], question.options[13])))
    assert final > groups + 8, (final, groups)
    llm = new_llm(max_model_len=groups + 4)  # every group fits, that final does not
    with pytest.raises(QuestionError, match=r"questions\[1\]: .*final round") as refusal:
        llm.decide(TEXT_MATERIAL, [QUESTIONS[1], question])
    assert refusal.value.param == "questions[1]"
    assert llm.engine.runner.stats.tokens_computed == 0 and not llm.engine.requests

    # What would have happened: the long options winning their groups, then a final round the engine refuses.
    plan = plan_decision("late", TEXT_MATERIAL, [question], inputs, max_prompt_tokens=final)  # that final fits here
    _, round1 = advance(plan, None)
    wins_first = [1.0] + [0.0] * 12, [1.0] + [0.0] * 13
    _, round2 = advance(plan, {b.request_id: Outcome(readout=r) for b, r in zip(round1.branches, wins_first, strict=True)})
    assert len(round2.branches[0].prompt.token_ids) == final
    (answer,) = llm.decide(TEXT_MATERIAL, [Question("choice", question.text, question.options[1:13] * 3)])
    assert abs(sum(answer.probabilities.values()) - 1) < 1e-5  # a grouped choice whose finals all fit is answered



def test_a_materials_own_error_is_refused_as_such_beside_a_grouped_choice():
    """Review (session 33): the grouped choice's up-front final-round check built its prompt before round 1's, so a
    material that cannot be prepared (here an image named by an unknown uuid) was refused as the grouped question's
    final round ("questions[i]: ... final round ..."), naming a question that has nothing wrong."""
    from prism.engine.chat import InputError

    material = [{"role": "user", "content": [{"type": "image", "image": None, "uuid": "never-sent"},
                                             {"type": "text", "text": "Look."}]}]
    llm = new_llm()
    with pytest.raises(InputError, match="names no image") as refusal:
        llm.decide(material, [QUESTIONS[1], _long_winners_question()])
    assert "final round" not in str(refusal.value) and not isinstance(refusal.value, QuestionError)
    assert llm.engine.runner.stats.tokens_computed == 0 and not llm.engine.requests
