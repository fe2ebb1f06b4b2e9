"""Spec: a decision's questions read what they read alone (the decision half of prefix identity, invariant 7).

`Engine.add_decision` forks every question from one shared material, prefilled once. Equal token ids are not equal
pictures: an image's pad tokens are the same for any picture of its size. So whatever pictures the branches show
(the same or different ones of one size, in the material or as a question's own picture after it), each branch's
readout must equal the readout of its prompt asked alone, and each forked question's KV content must name exactly
its prompt's media (its pages are published into the prefix cache under that content).

Historical: the material was the branches' common token ids, and a branch over another picture of the same size
read the first branch's image KV (session 27's review); then, after a first fix, a question's own picture after the
material was left out of its fork's KV content.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from prism.decision.questions import Question, candidate_token_ids
from prism.engine.llm import LLM
from prism.engine.request import Branch
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images

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
