"""A decision plan (`decision/plan.py`) driven through the async engine: its steps prepare prompts off the event loop,
its batches of readouts and generations run all or none."""

from __future__ import annotations

from ..decision.plan import Generations, Outcome, Readouts, advance
from ..engine.request import FinishReason, RequestOutput
from .cancellation import all_or_none
from .server_state import ServerState


async def run_plan(state: ServerState, plan) -> list:
    """A decision plan to its answers. Each plan step prepares prompts (template, image preprocessing): it runs off
    the event loop."""
    step, value = await state.async_engine.run_in_media_pool(advance, plan, None)
    while step == "work":
        outcomes = await run_work(state, value)
        step, value = await state.async_engine.run_in_media_pool(advance, plan, outcomes)
    return value


async def run_work(state: ServerState, work: Readouts | Generations) -> dict[str, Outcome]:
    """One batch of a decision plan through the async engine."""
    engine = state.async_engine
    if isinstance(work, Readouts) and work.decision_id is not None:
        finals = await engine.decide(work.decision_id, work.branches)
    elif isinstance(work, Readouts):
        events = await all_or_none(
            [engine.readout(b.request_id, b.prompt, b.candidates, b.temperature) for b in work.branches]
        )
        finals = {b.request_id: e for b, e in zip(work.branches, events, strict=True)}
    else:
        async def generate(request_id, prompt, params) -> tuple[RequestOutput, list[int]]:
            tokens: list[int] = []
            async for event in engine.generate(request_id, prompt, params):
                tokens += event.new_token_ids
            return event, tokens

        results = await all_or_none([generate(*r) for r in work.requests])
        return {
            rid: Outcome(None, tokens, e.prompt_tokens, e.cached_tokens, e.error, e.finish_reason is FinishReason.ABORT)
            for (rid, _, _), (e, tokens) in zip(work.requests, results, strict=True)
        }
    return {rid: Outcome(e.readout, None, e.prompt_tokens, e.cached_tokens, e.error) for rid, e in finals.items()}
