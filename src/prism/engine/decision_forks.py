"""A decision's material and its forks: questions over one material compute it once.

Owns *a decision's questions read what they read alone, over a material computed once*. `add_decision` checks every
branch as a request of its own before any is added (a refused decision leaves nothing running; a branch the pool
could never hold would wait for ever), then prefills the branches' shared prefix (`request.material_length`: cut
before the first picture the branches do not all show) as one material request. When that is computed,
`spawn_branches` forks each question from it, sharing its pages and copying on write, with the question's own tokens
and media as its KV content; each then computes only its question, all in the same steps. Until then a question's id
is taken (`Engine._unspawned`), and it ends with its material or alone when aborted (`Engine._end_question`).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from .detokenize import TextStream
from .request import Branch, FinishReason, Request, RequestError, RequestState, material_length
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine


def add_decision(engine: Engine, decision_id: str, branches: list[Branch]) -> list[str]:
    """`Engine.add_decision`: the branch request ids; a branch alone, or sharing nothing, is a readout request."""
    if not branches:
        raise RequestError("a decision needs at least one question")
    uses = Counter(b.request_id for b in branches)
    material_id = f"{decision_id}/material"
    if len(branches) > 1 and engine._id_in_use(material_id):
        raise RequestError(f"request id {material_id!r} is already in use")
    for b in branches:  # all checked before any is added: a refused decision leaves nothing running
        if engine._id_in_use(b.request_id) or uses[b.request_id] > 1:
            raise RequestError(f"request id {b.request_id!r} is already in use")
        engine._check_prompt(b.prompt, f"the prompt of {b.request_id!r}")
    shared = material_length(branches)
    engine.inputs.bind_names(*(b.prompt for b in branches))  # accepted: their image uuids name their images now
    if len(branches) == 1 or shared == 0:
        for b in branches:
            engine.add_readout_request(b.request_id, b.prompt, b.candidates, b.temperature)
        return [b.request_id for b in branches]
    material = engine.add_request(material_id, branches[0].prompt.prefix(shared), SamplingParams(max_tokens=1))
    material.branches = list(branches)
    engine._unspawned.update((b.request_id, material) for b in branches)
    return [b.request_id for b in branches]


def spawn_branches(engine: Engine, material: Request) -> None:
    """The material is computed: fork each branch from it, then let the material go (its pages stay referenced by
    the branches, and by the prefix cache)."""
    assert material.branches is not None
    for b in material.branches:
        del engine._unspawned[b.request_id]
        # The question's own tokens and media (an image of its own after the material) are its KV's content.
        engine.kv.fork(material.request_id, b.request_id, b.prompt.kv_content())
        branch = Request(b.request_id, b.prompt, SamplingParams(max_tokens=1), material.arrival_order)
        branch.readout_candidates = b.candidates
        branch.readout_temperature = b.temperature
        branch.cached_tokens = material.cached_tokens
        branch.transition(RequestState.RUNNING)
        engine.requests[b.request_id] = branch
        engine._streams[b.request_id] = TextStream(engine.inputs.tokenizer, branch.params, b.prompt.token_ids)
        engine.scheduler.running.append(branch)
    engine._finish(material, FinishReason.STOP)
