"""Spec: every decide ends (invariant 9, one terminal event per accepted request, for decisions).

Against the real engine on the tiny checkpoint, with a `max_model_len` (256) equal to its pool: decides of one to
four questions whose prompts fall on both sides of the limit. Each decide either
- is refused before anything runs (RequestError), and then some question's prompt really reaches max_model_len, or
- is answered within a bound of engine steps, every question's probabilities summing to 1, and no question's
  prompt reaches max_model_len (a branch computed past the model's length is a wrong answer, not a slow one);
and afterwards the engine holds no request and no sequence. A branch forked from the material without the checks a
request's prompt gets (the historical bug) waited for ever for pages the pool does not have, holding the engine. So
did a branch of max_model_len - 1 tokens that fits: copying on write the material's partly filled tail page, which
only cache entries still shared, needed one page past the pool (found by this spec's random examples, session 23).

A grouped choice (more than 26 options) asks its final round among the group winners only after its groups ran, so
what that round will be is known only then: it is refused before anything runs when some winners would make its
final round past the engine's prompt limit (and then such winners exist), and when it is not refused, whichever
options win their groups, its final round is a prompt the engine takes. Its final round used to be refused only when
built, after the groups had run, naming an engine request (found by review, session 33).

And a decide whose engine work fails anywhere (the material, a question's readout, a group's or the final round's,
a reasoning generation, a re-read) is never answered: it fails (`DecisionFailed`) naming a question whose work
failed, and the engine is left idle. A reasoning generation the engine failed used to be re-read as it stood, cut
short, and answered as if the question had thought (found by review, session 33).
"""

from __future__ import annotations

import re

from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from prism.decision.plan import DecisionFailed, Outcome, Readouts, advance, grouped, plan_decision
from prism.decision.questions import Question, QuestionError
from prism.decision.thinking import ThinkingConfig
from prism.engine.engine import RequestError
from prism.engine.llm import LLM
from prism.engine.request import RequestOutput
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.shared_engines import reused_while_clean

MAX_MODEL_LEN = 256
MAX_STEPS = 60  # a decide here takes a handful of steps; a waiting branch never ends
MATERIAL = [{"role": "user", "content": "Read this note carefully: the lamp is on and the door is shut."}]


@reused_while_clean
def engine_under_test() -> LLM:
    """One engine for the examples (built once: a few seconds) while it holds nothing of the last one (a decide's
    requests are named spec/material, spec/q0, ... in every example), its pool exactly max_model_len tokens."""
    return LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=4, num_gpu_pages=MAX_MODEL_LEN // 4,
               max_model_len=MAX_MODEL_LEN, check_invariants=True)


def decide_within(llm: LLM, questions: list[Question], max_steps: int) -> list:
    """`LLM.decide`, with the engine's steps bounded (AssertionError when a question is still unanswered)."""
    engine = llm.engine
    plan = plan_decision("spec", MATERIAL, questions, engine.inputs)  # no thinking: readouts only
    state, work = advance(plan, None)
    while state == "work":
        assert isinstance(work, Readouts)
        ids = (engine.add_decision(work.decision_id, work.branches) if work.decision_id is not None
               else [engine.add_readout_request(b.request_id, b.prompt, b.candidates, b.temperature).request_id
                     for b in work.branches])
        finals: dict[str, RequestOutput] = {}
        for _ in range(max_steps):
            finals.update((e.request_id, e) for e in engine.step() if e.finished and e.request_id in ids)
            if len(finals) == len(ids):
                break
        unanswered = sorted(set(ids) - set(finals))
        assert not unanswered, f"questions {unanswered} not answered after {max_steps} steps (a decide must end)"
        state, work = advance(plan, {i: Outcome(readout=finals[i].readout, error=finals[i].error) for i in ids})
    return work


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 120), min_size=1, max_size=4))
# A branch of max_model_len - 1 tokens (padding 64): besides the whole pool it needs the material's partly filled
# tail page, which the material's cache entry (and a sibling, until it has copied it) also holds.
@example([0, 64])
@example([64, 64])
def spec_every_decide_is_answered_or_refused_before_it_runs(padding: list[int]) -> None:
    llm = engine_under_test()
    questions = [Question("yes_no", f"Question {i}: is the lamp " + "very " * k + "bright?")
                 for i, k in enumerate(padding)]
    lengths = [len(llm.engine.inputs.prepare_chat([*MATERIAL, {"role": "user", "content": q.render()}]).token_ids)
               for q in questions]
    try:
        answers = decide_within(llm, questions, MAX_STEPS)
    except RequestError as error:
        assert max(lengths) >= MAX_MODEL_LEN, f"refused ({error}) though every prompt fits: {lengths}"
    else:
        assert max(lengths) < MAX_MODEL_LEN, f"answered with a prompt of {max(lengths)} tokens past max_model_len"
        assert all(abs(sum(a.probabilities.values()) - 1) < 1e-5 for a in answers)
    assert not llm.engine.requests and not llm.engine.kv.seqs, "a decide left requests or sequences behind"


QUESTION_GROUP = re.compile(r"/q\d+g(\d+)$")  # a group's readout: <decide>/q<i>g<g>


@settings(max_examples=40, deadline=None)
# (groups of few options leave a group's long option the most room: 2 groups of 13 to 16 options, 3 of 17 to 22)
@given(data=st.data(), count=st.integers(27, 32) | st.integers(53, 64) | st.integers(27, 120), before=st.booleans())
def spec_a_grouped_choice_is_refused_up_front_or_its_final_round_fits(data, count, before) -> None:
    llm = engine_under_test()
    engine = llm.engine

    def prompt(question: Question):
        return engine.inputs.prepare_chat([*MATERIAL, {"role": "user", "content": question.render()}])

    def refused(question: Question) -> bool:
        try:
            engine._check_prompt(prompt(question))
        except RequestError:
            return True
        return False

    # Each group: one option of k more tokens ("a " is one token of the tiny tokenizer) at a drawn place, the others
    # short, so that the longest final round is that of the long ones. k is drawn around the room a group of short
    # options leaves (the group sizes are those of any choice of `count`), where a group fits and a final may not.
    sizes = [len(g.options) for g in grouped(Question("choice", "Which fits?", ("end",) * count))]
    room = engine.max_prompt_tokens - len(prompt(Question("choice", "Which fits?", ("end",) * max(sizes))).token_ids)
    options = []
    for size in sizes:
        where = data.draw(st.integers(0, size - 1))
        k = data.draw(st.integers(room * 3 // 4, room + 4) if data.draw(st.integers(0, 9)) else st.just(0))
        options += ["a " * k + "end" if place == where else "end" for place in range(size)]
    choice = Question("choice", "Which fits?", tuple(options))
    questions = [Question("yes_no", "Is the lamp on?"), choice] if before else [choice]
    index = questions.index(choice)
    groups = grouped(choice)

    def final_round(winners: list[int]) -> list:
        """The final round's branches when each group's readout is certain of its winner (`winners`: by place)."""
        plan = plan_decision("spec", MATERIAL, questions, engine.inputs, max_prompt_tokens=engine.max_prompt_tokens)
        _, round1 = advance(plan, None)
        outcomes = {}
        for b in round1.branches:
            group = QUESTION_GROUP.search(b.request_id)
            winner = winners[int(group.group(1))] if group else 0
            outcomes[b.request_id] = Outcome(readout=[1.0 if k == winner else 0.0 for k in range(len(b.candidates))])
        return advance(plan, outcomes)[1].branches

    longest = [g.options.index(max(g.options, key=len)) for g in groups]
    groups_fit = not any(refused(g) for g in groups)  # (else the engine refuses the decide before anything runs)
    try:
        advance(plan_decision("spec", MATERIAL, questions, engine.inputs, max_prompt_tokens=engine.max_prompt_tokens),
                None)
    except QuestionError as error:
        assert error.param == f"questions[{index}]", f"the refusal names {error.param!r}: {error}"
        assert refused(Question("choice", choice.text, tuple(g.options[w] for g, w in zip(groups, longest, strict=True)))), \
            f"refused ({error}) though every final round fits"
        event(f"refused up front ({'its groups fit' if groups_fit else 'a group too long too'})")
        return
    if not groups_fit:
        event("a group refused by the engine (before anything runs)")
        return
    # the longest options winning (the worst case), and drawn winners
    drawn = [data.draw(st.integers(0, len(g.options) - 1), label=f"winner of group {k}") for k, g in enumerate(groups)]
    for winners in (longest, drawn):
        for b in final_round(winners):
            try:
                engine._check_prompt(b.prompt, b.request_id)
            except RequestError as error:
                raise AssertionError(f"the final round of winners {winners} was refused after the groups ran: "
                                     f"{error}") from error
    event("final round taken")


POOL = [Question("yes_no", "Is the lamp on?"), Question("score", "How bright is it?", levels=(1, 2, 3)),
        Question("choice", "Which is shut?", ("the lamp", "the door", "nothing")),
        Question("choice", "Which word fits?", tuple(f"word {k}" for k in range(30)))]  # grouped: 15 + 15, then final
STAGES = {"material": "/material", "readout": "/q{i}", "group": "/q{i}g1", "final": "/q{i}final",
          "reasoning": "/q{i}/think", "re-read": "/q{i}/reread"}
QUESTION_ID = re.compile(r"/q(\d+)")  # a question's engine requests: <decide>/q<i>, /q<i>g<g>, /q<i>final, /q<i>/...


@reused_while_clean
def engine_with_failures() -> LLM:
    """Thinking decides on one engine (while it holds nothing of the last one); steps go through `runner.execute`
    alone (no steps launched ahead), where a failure is planted."""
    return LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=4, num_gpu_pages=256, async_scheduling=False,
               check_invariants=True)


@settings(max_examples=20, deadline=None)
@given(picks=st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=3), stage=st.sampled_from(sorted(STAGES)),
       which=st.integers(0, 2))
def spec_a_decide_whose_work_fails_is_never_answered(picks, stage, which) -> None:
    llm = engine_with_failures()
    engine = llm.engine
    questions = [POOL[p] for p in picks]
    suffix = STAGES[stage].format(i=which % len(questions))
    execute = engine.runner.execute
    failed: set[str] = set()

    def fail_the_stage_once(slices, *args, **kwargs):
        ids = {s.request.request_id for s in slices}
        if not failed and any(i.endswith(suffix) for i in ids):
            failed.update(ids)
            raise RuntimeError(f"planted failure of a step of {sorted(ids)}")
        return execute(slices, *args, **kwargs)

    engine.runner.execute = fail_the_stage_once
    try:
        answers = llm.decide(MATERIAL, questions, ThinkingConfig(gate=1.0, max_tokens=4))
    except DecisionFailed as error:
        assert failed, f"the decide failed ({error}) though none of its work did"
        named = {f"question {m.group(1)}" for m in map(QUESTION_ID.search, failed) if m}
        assert any(n in str(error) for n in named) or any(q.endswith("/material") for q in failed), \
            f"the decide failed naming none of the questions whose work failed ({sorted(failed)}): {error}"
        event(f"failed at the {stage}")
    else:
        event(f"no {stage} to fail")
        assert not failed, f"answered {[a.answer for a in answers]} although its step of {sorted(failed)} failed"
    finally:
        engine.runner.execute = execute
    assert not engine.requests and not engine.kv.seqs and not engine._unspawned, "a decide left work behind"
