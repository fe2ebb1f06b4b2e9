"""The engine thread hands a step's events to the event loop in one call, not one per event (each
`call_soon_threadsafe` is a write to the loop's wake-up socket and a wake-up); the events still reach each stream
whole and in order."""

from __future__ import annotations

import asyncio

import pytest

from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.serving import async_engine
from prism.serving.async_engine import AsyncEngine
from prism.testing.checkpoints import ensure_tiny_checkpoint

STREAMS = 6
TOKENS = 5


def _run_streams(front: AsyncEngine, prompt, counted: list[int]) -> dict[str, list]:
    async def one(i: int) -> list:
        events = await front.start_generation(f"r{i}", prompt, SamplingParams.greedy(TOKENS, ignore_eos=True))
        return [event async for event in events]

    async def main() -> dict[str, list]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            if callback is async_engine._deliver:
                counted.append(len(args[0]))  # events in this hand-over
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        results = await asyncio.gather(*(one(i) for i in range(STREAMS)))
        return {f"r{i}": r for i, r in enumerate(results)}

    return asyncio.run(main())


@pytest.fixture(scope="module")
def llm():
    return LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=16, num_gpu_pages=256)


def test_a_steps_events_reach_the_loop_in_one_hand_over(llm):
    front = AsyncEngine(llm.engine, max_in_flight=STREAMS)
    prompt = llm.engine.inputs.prepare_prompt("Count.")
    counted: list[int] = []
    front.start()
    try:
        results = _run_streams(front, prompt, counted)
    finally:
        front.shutdown()
    for request_id, events in results.items():
        assert sum(len(e.new_token_ids) for e in events) == TOKENS, request_id
        assert [e.finished for e in events] == [False] * (len(events) - 1) + [True], request_id
    events_delivered = STREAMS * TOKENS  # at least one event per token (a terminal one may carry the last)
    assert sum(counted) >= events_delivered
    # Every hand-over carries a step's events: far fewer hand-overs than events, about one per decode step.
    assert len(counted) <= TOKENS + 2, f"{len(counted)} hand-overs for {sum(counted)} events: {counted}"


def test_the_check_fails_when_each_event_is_handed_over_alone(llm, monkeypatch):
    """Planted: the hand-over of one event per call (before this change)."""
    front = AsyncEngine(llm.engine, max_in_flight=STREAMS)
    prompt = llm.engine.inputs.prepare_prompt("Count.")
    counted: list[int] = []

    real = AsyncEngine._hand_over

    def one_event_per_hand_over(self, events):
        for event in events:
            real(self, [event])

    monkeypatch.setattr(AsyncEngine, "_hand_over", one_event_per_hand_over)
    front.start()
    try:
        _run_streams(front, prompt, counted)
    finally:
        front.shutdown()
    assert len(counted) > TOKENS + 2, "the planted one-event-per-call delivery was not seen by the count"
