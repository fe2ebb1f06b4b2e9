"""A decide request as a plan of engine work, written once and driven by both the offline API (`LLM`)
and the server (`AsyncEngine`).

The plan is a generator: it yields batches of work (readouts forked from the material, plain readouts,
or generations) and receives each batch's outcomes, until it returns the answers. Round 1 reads every
question from one material; a choice question with more than 26 options is asked in grouped rounds
(groups of at most 26, then a final round among the group winners); gated thinking, when asked for,
re-reads the questions whose confidence stays below the gate after reasoning.

Owns that a decide is refused before anything runs when a round it may reach cannot be asked (a grouped choice's
longest final round past the engine's prompt limit), and that each answer's usage counts every engine request its
question made: every round, a reasoning generation's prompt and tokens, its re-read.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Generator
from dataclasses import dataclass

from ..engine.chat import InputError
from ..engine.request import Branch
from ..engine.sampling import SamplingParams
from .questions import (
    MAX_OPTIONS,
    Answer,
    Question,
    QuestionError,
    candidate_token_ids,
    make_answer,
    option_line,
)
from .thinking import ThinkingConfig, answer_after_thinking, reasoning_of, thinking_request


@dataclass(frozen=True)
class Readouts:
    """Branches to read; with a `decision_id` they fork from their shared material (Engine.add_decision)."""

    decision_id: str | None
    branches: list[Branch]


@dataclass(frozen=True)
class Generations:
    requests: list[tuple[str, object, SamplingParams]]  # (request id, PreparedPrompt, params)


@dataclass
class Outcome:
    readout: list[float] | None = None
    token_ids: list[int] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    aborted: bool = False  # a generation that ended aborted (a readout's is one without readout or error)


Plan = Generator[Readouts | Generations, dict[str, Outcome], list[Answer]]


def grouped(question: Question) -> list[Question]:
    """The round-1 questions of a choice with more than 26 options: consecutive groups of at most 26, as even as
    they can be (27 options are 13 + 14, never 26 + a group of one, which is no question)."""
    options = question.options
    count = -(-len(options) // MAX_OPTIONS)
    bounds = [len(options) * g // count for g in range(count + 1)]
    return [
        Question("choice", question.text, options[lo:hi], temperature=question.temperature)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]


def longest_final(question: Question, encode) -> Question:
    """Of the final rounds a grouped choice can reach, one whose prompt is the longest: each group's option whose line
    has the most tokens there. A line's tokens do not depend on the lines around it (Qwen's pre-tokenizer ends a piece
    at the newline that ends a line, and the next begins with its label's letter), so no other winners make a longer
    prompt."""
    winners = [max(group.options, key=lambda option: len(encode(option_line(label, option))))
               for label, group in zip(string.ascii_uppercase, grouped(question), strict=False)]
    return Question("choice", question.text, tuple(winners), temperature=question.temperature)


class DecisionFailed(RuntimeError):
    """A question's readout ended without probabilities, or its reasoning did not end (the engine failed it, or
    `aborted` it)."""

    def __init__(self, message: str, aborted: bool = False) -> None:
        super().__init__(message)
        self.aborted = aborted


def located(error: QuestionError, index: int) -> QuestionError:
    """`error` as the refusal of the decide's questions[index]: its message and its param say which."""
    refusal = QuestionError(f"questions[{index}]: {error}")
    refusal.param = f"questions[{index}]"
    return refusal


def usage_of(spent: list[Outcome]) -> tuple[int, int, int]:
    """A question's usage from every engine request made for it: (prompt tokens, of them from the prefix cache,
    generated tokens)."""
    return (sum(o.prompt_tokens for o in spent), sum(o.cached_tokens for o in spent),
            sum(len(o.token_ids or ()) for o in spent))


def reasoning_tokens(outcome: Outcome, index: int) -> list[int]:
    """A question's reasoning generation as it ended; one the engine failed or aborted fails the question (its
    re-read would show a reasoning cut short, answered as if it had thought)."""
    if outcome.error is not None or outcome.aborted:
        raise DecisionFailed(f"question {index}'s reasoning failed: {outcome.error or 'aborted'}",
                             aborted=outcome.error is None)
    return list(outcome.token_ids or ())


def plan_decision(decision_id: str, material: list[dict], questions: list[Question], inputs,
                  thinking: ThinkingConfig | None = None, max_prompt_tokens: int | None = None) -> Plan:
    """`max_prompt_tokens`: the engine's (`Engine.max_prompt_tokens`); reasoning is cut short so that its re-read
    fits."""
    if not questions:
        raise QuestionError("a decide needs at least one question")
    for i, q in enumerate(questions):
        if not isinstance(q, Question):
            raise QuestionError(f"question {i} is a {type(q).__name__}: questions are "
                                "prism.decision.questions.Question objects")
    if thinking is not None and not isinstance(thinking, ThinkingConfig):
        raise QuestionError(f"thinking is a {type(thinking).__name__}: pass a prism.decision.thinking.ThinkingConfig")
    media_memo: dict = {}  # the material's images and videos are prepared once, not once per question

    def branch(request_id: str, question: Question) -> Branch:
        prompt = inputs.prepare_chat([*material, {"role": "user", "content": question.render()}],
                                     media_memo=media_memo, bind_names=False)  # bound when the engine accepts
        return Branch(request_id, prompt, candidate_token_ids(question, inputs.encode), question.temperature)

    spent: dict[int, list[Outcome]] = {i: [] for i in range(len(questions))}  # each question's engine requests

    def read(outcome: Outcome, index: int, question: Question) -> Answer:
        spent[index].append(outcome)
        if outcome.readout is None:
            raise DecisionFailed(f"question {index} failed: {outcome.error or 'aborted'}", aborted=outcome.error is None)
        return make_answer(index, question, outcome.readout)

    def final_branch(index: int, final: Question) -> Branch:
        try:
            return branch(f"{decision_id}/q{index}final", final)
        except QuestionError as error:
            raise located(error, index) from error

    # Round 1: every question (grouped ones as their groups), forked from one material.
    asked: list[tuple[str, int, Question]] = []  # (request id, question index, question asked)
    for i, q in enumerate(questions):
        subs = grouped(q) if q.kind == "choice" and len(q.options) > MAX_OPTIONS else [q]
        if len(subs) > MAX_OPTIONS:
            raise located(QuestionError(f"{len(q.options)} options are more than {MAX_OPTIONS} groups of "
                                        f"{MAX_OPTIONS}"), i)
        asked += [(f"{decision_id}/q{i}" + (f"g{g}" if len(subs) > 1 else ""), i, sub) for g, sub in enumerate(subs)]
    round1 = []
    for request_id, i, sub in asked:
        try:
            round1.append(branch(request_id, sub))
        except QuestionError as error:  # e.g. an answer of several tokens: say which question
            raise located(error, i) from error
    # A grouped question's final round is built after its groups ran: the longest it can reach must fit now. (After
    # round 1's branches, so that the material's own errors are refused as such, not as a final round's.)
    for i in sorted({i for _, i, sub in asked if sub is not questions[i]}):  # the grouped ones
        try:
            longest = final_branch(i, longest_final(questions[i], inputs.encode)).prompt
        except InputError as error:
            raise located(QuestionError(f"its final round among the group winners cannot be asked: {error}"),
                          i) from error
        if max_prompt_tokens is not None and len(longest.token_ids) > max_prompt_tokens:
            raise located(QuestionError(
                f"its final round among the group winners can be {len(longest.token_ids)} tokens long (its groups' "
                f"longest options winning), past the limit of {max_prompt_tokens}: shorten its longest options"), i)
    by_question = {i: b for (_, i, _), b in zip(asked, round1, strict=True)}  # ungrouped questions' branches
    outcomes = yield Readouts(decision_id, round1)
    answers: dict[int, Answer] = {}
    # grouped questions: (index, the group winners' positions, the final round among them)
    finals: list[tuple[int, list[int], Question]] = []
    for i, q in enumerate(questions):
        parts = [(rid, sub) for rid, qi, sub in asked if qi == i]
        if len(parts) == 1:
            answers[i] = read(outcomes[parts[0][0]], i, q)
            continue
        winners, first = [], 0  # each group's winner, as its position among the question's options
        for rid, sub in parts:
            group = read(outcomes[rid], i, sub)
            winners.append(first + sub.labels.index(group.answer))
            first += len(sub.options)
        finals.append((i, winners, Question("choice", q.text, tuple(q.options[w] for w in winners),
                                            temperature=q.temperature)))
    if finals:  # Round 2: the group winners of each grouped question, forked from the same material
        round2 = [final_branch(i, final) for i, _, final in finals]
        outcomes = yield Readouts(f"{decision_id}/final", round2)
        for (i, winners, final), b in zip(finals, round2, strict=True):
            final_answer = read(outcomes[b.request_id], i, final)
            # The distribution over all options: the final round's probability for each group winner (by its
            # position: option texts may repeat); options that lost inside their group get 0. The answer is
            # the final round's winner.
            labels = questions[i].labels
            probs = {label: 0.0 for label in labels}
            for label, position in zip(final.labels, winners, strict=True):
                probs[labels[position]] = final_answer.probabilities[label]
            best = max(probs, key=lambda label: probs[label])
            answers[i] = Answer(i, "choice", probs, best, probs[best])

    grouped_questions = {i for i, _, _ in finals}
    doubtful = [] if thinking is None else [
        i for i in sorted(answers) if answers[i].confidence < thinking.gate and i not in grouped_questions
    ]
    # Gated thinking: reason, then read again (a question whose prompt leaves no room keeps its first readout)
    thinkers, requests = [], []
    for i in doubtful:
        request = thinking_request(by_question[i].prompt, questions[i], thinking, inputs.encode, max_prompt_tokens)
        if request is not None:
            thinkers.append(i)
            requests.append((f"{decision_id}/q{i}/think", *request))
    if thinkers:
        generated = yield Generations(requests)
        for i in thinkers:
            spent[i].append(generated[f"{decision_id}/q{i}/think"])
        thoughts = {i: reasoning_tokens(generated[f"{decision_id}/q{i}/think"], i) for i in thinkers}
        decode = functools.partial(inputs.decode, skip_special_tokens=False)
        rereads = [
            Branch(f"{decision_id}/q{i}/reread",
                   answer_after_thinking(by_question[i].prompt,
                                         reasoning_of(thoughts[i], decode, inputs.eos_token_ids), inputs.encode),
                   by_question[i].candidates, by_question[i].temperature)
            for i in thinkers
        ]
        outcomes = yield Readouts(None, rereads)
        for i, b in zip(thinkers, rereads, strict=True):
            answer = read(outcomes[b.request_id], i, questions[i])
            answer.thought, answer.thinking_tokens = True, len(thoughts[i])
            answers[i] = answer
    for i, answer in answers.items():
        answer.prompt_tokens, answer.cached_tokens, answer.completion_tokens = usage_of(spent[i])
    return [answers[i] for i in range(len(questions))]


def advance(plan: Plan, outcomes: dict[str, Outcome] | None) -> tuple[str, object]:
    """One step of a plan: ("work", next batch) or ("done", answers). (Safe to run in a thread pool,
    where a StopIteration could not cross a future.)"""
    try:
        return "work", (next(plan) if outcomes is None else plan.send(outcomes))
    except StopIteration as done:
        return "done", done.value
