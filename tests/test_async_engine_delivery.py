"""The engine thread hands a step's events to the event loop in one call, not one per event (each
`call_soon_threadsafe` is a write to the loop's wake-up socket and a wake-up); the events still reach each stream
whole and in order. A loop that has closed loses only its own streams (their requests are aborted), not the
deliveries to other loops."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.serving import async_engine
from prism.serving.async_engine import AsyncEngine
from prism.testing.checkpoints import ensure_tiny_checkpoint

STREAMS = 6
TOKENS = 5


@pytest.fixture(scope="module")
def llm():
    return LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=16, num_gpu_pages=256)


def _run_streams(front: AsyncEngine, prompt) -> tuple[dict[str, list], list[int], int]:
    """(each stream's events, the events in each hand-over to the loop, the steps that had events to hand over)."""
    counted: list[int] = []
    steps = [0]
    real_hand_over = front._hand_over

    def counting_steps(events):
        steps[0] += bool(events)
        real_hand_over(events)

    front._hand_over = counting_steps

    async def one(i: int) -> list:
        events = await front.start_generation(f"r{i}", prompt, SamplingParams.greedy(TOKENS, ignore_eos=True))
        return [event async for event in events]

    async def main() -> list[list]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            if callback is async_engine._deliver:
                counted.append(len(args[0]))  # events in this hand-over
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        return await asyncio.gather(*(one(i) for i in range(STREAMS)))

    front.start()
    try:
        results = asyncio.run(main())
    finally:
        front.shutdown()
    return {f"r{i}": r for i, r in enumerate(results)}, counted, steps[0]


def test_a_steps_events_reach_the_loop_in_one_hand_over(llm):
    front = AsyncEngine(llm.engine, max_in_flight=STREAMS)
    results, counted, steps = _run_streams(front, llm.engine.inputs.prepare_prompt("Count."))
    for request_id, events in results.items():
        assert sum(len(e.new_token_ids) for e in events) == TOKENS, request_id
        assert [e.finished for e in events] == [False] * (len(events) - 1) + [True], request_id
    assert sum(counted) >= STREAMS * TOKENS  # at least one event per token (a terminal one may carry the last)
    assert len(counted) <= steps, f"{len(counted)} hand-overs in {steps} steps: {counted}"
    assert max(counted) > 1, f"no step had several streams' events to hand over: {counted}"


def test_the_check_fails_when_each_event_is_handed_over_alone(llm, monkeypatch):
    """Planted: one hand-over per event (before this change)."""
    real = AsyncEngine._hand_over

    def one_event_per_hand_over(self, events):
        for event in events:
            real(self, [event])

    monkeypatch.setattr(AsyncEngine, "_hand_over", one_event_per_hand_over)
    front = AsyncEngine(llm.engine, max_in_flight=STREAMS)
    with pytest.raises(AssertionError, match="hand-overs in"):
        _, counted, steps = _run_streams(front, llm.engine.inputs.prepare_prompt("Count."))
        assert len(counted) <= steps, f"{len(counted)} hand-overs in {steps} steps: {counted}"


def test_a_closed_loop_loses_only_its_own_streams(llm):
    """A request whose event loop closes under it is aborted (its slot given back); a stream on another loop,
    served by the same steps, gets every event."""
    front = AsyncEngine(llm.engine, max_in_flight=2)
    prompt = llm.engine.inputs.prepare_prompt("Count.")
    doomed = asyncio.new_event_loop()
    thread = threading.Thread(target=doomed.run_forever, daemon=True)
    thread.start()
    front.start()
    try:
        started = asyncio.run_coroutine_threadsafe(
            front.start_generation("doomed", prompt, SamplingParams.greedy(200, ignore_eos=True)), doomed)
        started.result(timeout=30)  # accepted; nobody reads its events
        doomed.call_soon_threadsafe(doomed.stop)
        thread.join(10)
        doomed.close()

        async def survivor() -> list:
            events = await front.start_generation("survivor", prompt, SamplingParams.greedy(TOKENS, ignore_eos=True))
            return [event async for event in events]

        # (bounded: an engine thread that died on the closed loop would leave it waiting for ever)
        events = asyncio.run(asyncio.wait_for(survivor(), 30))
        assert sum(len(e.new_token_ids) for e in events) == TOKENS and events[-1].finished
        deadline = time.time() + 10
        while ("doomed" in llm.engine.requests or front._slots_taken) and time.time() < deadline:
            time.sleep(0.05)
        assert "doomed" not in llm.engine.requests, "the closed loop's request still runs"
        assert front._slots_taken == 0
    finally:
        front.shutdown()
