"""Spec: a decision's questions read what they read alone (the decision half of prefix identity, invariant 7).

`Engine.add_decision` forks every question from one shared material, prefilled once. Equal token ids are not equal
pictures: an image's pad tokens are the same for any picture of its size. So whatever pictures the branches show
(the same or different ones of one size, in the material or as a question's own picture after it), each branch's
readout must equal the readout of its prompt asked alone, and each forked question's KV content must name exactly
its prompt's media (its pages are published into the prefix cache under that content).

And against a reference computed apart (HF transformers on the same checkpoint, the material and the question as one
prompt): each answer's probabilities are the softmax of its answers' logits at the question's last position at its
temperature (grouped choices: round by round), whatever the decide's other questions, their order or a cache hit.

Historical: the material was the branches' common token ids, and a branch over another picture of the same size
read the first branch's image KV (session 27's review); then, after a first fix, a question's own picture after the
material was left out of its fork's KV content.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from prism.decision.questions import Question, candidate_token_ids
from prism.engine.llm import LLM
from prism.engine.request import Branch
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images
from prism.testing.shared_engines import reused_while_clean

PICTURES = random_images([(32, 32)] * 3, seed=11)  # one size: equal pad tokens for all three
QUESTIONS = [Question("yes_no", "Is it red?"), Question("yes_no", "Is it dark?")]

BRANCH = st.tuples(st.integers(0, 2), st.integers(0, 1), st.one_of(st.none(), st.integers(0, 2)))  # material
# picture, question, the question's own picture


def new_llm() -> LLM:
    return LLM(ensure_tiny_checkpoint(), dtype="float32", kv_dtype="fp32", page_size=4, num_gpu_pages=256,
               check_invariants=True)


def branch_of(llm: LLM, index: int, material: int, question: int, own: int | None) -> Branch:
    q = QUESTIONS[question]
    ask = [{"type": "text", "text": "And this one:"}, {"type": "image", "image": PICTURES[own]}] if own is not None else []
    messages = [{"role": "user", "content": [{"type": "image", "image": PICTURES[material]},
                                             {"type": "text", "text": "Look."}]},
                {"role": "user", "content": [*ask, {"type": "text", "text": q.render()}]}]
    return Branch(f"q{index}", llm.engine.inputs.prepare_chat(messages), candidate_token_ids(q, llm.engine.inputs.encode))


def readouts(llm: LLM) -> dict[str, list[float]]:
    out = {}
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            assert output.error is None, output.error
            if output.finished and output.readout is not None:
                out[output.request_id] = output.readout
    return out


@settings(max_examples=15, deadline=None)
@given(st.lists(BRANCH, min_size=2, max_size=3))
def spec_each_question_reads_what_it_reads_alone(choices) -> None:
    llm = new_llm()
    branches = [branch_of(llm, i, *c) for i, c in enumerate(choices)]
    forked = {}
    fork = llm.engine.kv.fork

    def recording_fork(parent, child, content=None):
        seq = fork(parent, child, content)
        forked[child] = [(m.start, m.length, m.digest) for m in seq.content.media]
        return seq

    llm.engine.kv.fork = recording_fork
    llm.engine.add_decision("d", branches)
    together = readouts(llm)
    for b in branches:
        if b.request_id in forked:
            assert forked[b.request_id] == [(s.start, s.length, s.digest) for s in b.prompt.media_spans()], \
                f"the fork of {b.request_id} names other media than its prompt"
    alone_llm = new_llm()
    for b in branches:
        alone_llm.engine.add_readout_request(b.request_id, b.prompt, b.candidates)
    alone = readouts(alone_llm)
    for b in branches:
        gap = max(abs(x - y) for x, y in zip(together[b.request_id], alone[b.request_id], strict=True))
        assert gap < 1e-4, f"{b.request_id} reads {together[b.request_id]} in the decision, {alone[b.request_id]} " \
                           f"alone: it read another picture's KV"
    event("forked" if forked else "no material shared")
    if len({c[0] for c in choices}) > 1:
        event("material pictures differ")
    if any(c[2] is not None for c in choices):
        event("a question shows a picture of its own")


# -- the reference: HF transformers' logits of each question's whole prompt -------------------------------------------
ORACLE_MATERIAL_IMAGE = random_images([(64, 96)], seed=12)[0]
ORACLE_MATERIAL = [
    {"role": "system", "content": "You answer questions about pictures."},
    {"role": "user", "content": [{"type": "image", "image": ORACLE_MATERIAL_IMAGE}, {"type": "text", "text": "Look."}]},
    {"role": "assistant", "content": "I have looked at it."},
]
ORACLE_QUESTIONS = [
    Question("choice", "Which fits?", ("the first", "the second", "neither")),
    Question("yes_no", "Is it dark?"),
    Question("score", "How bright?", levels=(1, 2, 3, 4, 5), temperature=0.3),
    Question("choice", "Wähle: A or B?", ("A", "B", "A. B", "é 中文 🙂", "A"), temperature=7.5),
    Question("yes_no", "Is it red?", temperature=1e-6),
    Question("score", "How noisy?", levels=(9, 0, 4)),
    Question("choice", "Which letter?", tuple(f"letter {c}" for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ")),  # 26: one round
    Question("choice", "Which word?", tuple(f"word {k % 20}" for k in range(27))),  # 27: groups of 13 and 14
]


@functools.cache
def hf_reference():
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from prism.testing.hf_reference import hf_processor

    checkpoint = ensure_tiny_checkpoint()
    model = Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
    return model, hf_processor(checkpoint)


@functools.cache
def reference_probabilities(question: Question) -> tuple[float, ...]:
    """softmax(logits[candidates] / temperature) at the last position of the material and the question as one
    prompt, computed by HF transformers alone."""
    import torch

    from prism.testing.hf_reference import ReferenceInputs

    model, processor = hf_reference()
    messages = [{"role": m["role"], "content": [{"type": "image"} if part["type"] == "image" else part
                                                for part in (m["content"] if isinstance(m["content"], list)
                                                             else [{"type": "text", "text": m["content"]}])]}
                for m in ORACLE_MATERIAL]
    messages.append({"role": "user", "content": [{"type": "text", "text": question.render()}]})
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=[ORACLE_MATERIAL_IMAGE], return_tensors="pt")
    inputs = ReferenceInputs(out["input_ids"], out["mm_token_type_ids"], torch.empty(0), out["pixel_values"],
                             out["image_grid_thw"])
    with torch.no_grad():
        logits = model(**inputs.hf_kwargs()).logits[0, -1].double()
    candidates = candidate_token_ids(question, oracle_llm().engine.inputs.encode)
    return tuple(torch.softmax(logits[list(candidates)] / question.temperature, 0).tolist())


@reused_while_clean
def oracle_llm() -> LLM:
    """Shared by the examples while it holds nothing of the last one: a sequence a failed decide left would fail the
    next one's checks that none is left and that the cleared cache frees every page."""
    return new_llm()


def expected_answer(question: Question) -> dict[str, float]:
    """The reference distribution over the question's answers: one readout, or (more than 26 options) the final
    round's over the group winners, each the best of its group's readout, the others 0."""
    from prism.decision.plan import grouped

    if len(question.options) <= 26:
        return dict(zip(question.labels, reference_probabilities(question), strict=True))
    winners, first = [], 0
    for group in grouped(question):
        probs = reference_probabilities(group)
        winners.append(first + max(range(len(probs)), key=lambda k: (probs[k], -k)))
        first += len(group.options)
    final = Question("choice", question.text, tuple(question.options[w] for w in winners),
                     temperature=question.temperature)
    expected = dict.fromkeys(question.labels, 0.0)
    for w, p in zip(winners, reference_probabilities(final), strict=True):
        expected[question.labels[w]] = p
    return expected


@settings(max_examples=10, deadline=None)
@given(st.lists(st.sampled_from(range(len(ORACLE_QUESTIONS))), min_size=1, max_size=5), st.booleans())
def spec_each_answer_is_the_reference_softmax(picks, twice) -> None:
    """Whatever the other questions of the decide, their order, and whether the material is a cache hit (`twice`):
    each answer's probabilities are the reference's (HF transformers' logits of its whole prompt, softmax over its
    answers' tokens at its temperature), its answer the most likely (the first on ties), its confidence that
    probability, a score's expected value the levels weighted by their probabilities; and once answered the decide
    holds no sequence, its pages only the prefix cache's."""
    llm = oracle_llm()
    questions = [ORACLE_QUESTIONS[p] for p in picks]
    for _ in range(2 if twice else 1):
        answers = llm.decide(ORACLE_MATERIAL, questions)
        assert not llm.engine.kv.seqs and not llm.engine.requests, "a decide left a sequence or a request"
        llm.engine.kv.check_invariants()
    for question, answer in zip(questions, answers, strict=True):
        expected = expected_answer(question)
        assert list(answer.probabilities) == list(question.labels)
        gap = max(abs(answer.probabilities[label] - p) for label, p in expected.items())
        assert gap < 1e-5, f"{question.text!r}: {answer.probabilities} against the reference {expected}"
        best = max(question.labels, key=lambda label: (expected[label], -question.labels.index(label)))
        if expected[best] - sorted(expected.values())[-2] > 1e-5:  # (a near tie may go either way)
            assert answer.answer == best, f"{question.text!r}: answered {answer.answer}, the reference's best is {best}"
        assert answer.confidence == answer.probabilities[answer.answer] == max(answer.probabilities.values())
        if question.kind == "score":
            assert answer.expected_value == pytest.approx(
                sum(level * answer.probabilities[str(level)] for level in question.levels))
    event("a cache hit" if twice else "cold")
    llm.engine.kv.clear_cache()
    assert llm.engine.kv.gpu.num_free == llm.engine.kv.gpu.num_pages, "pages held after the cache was cleared"
