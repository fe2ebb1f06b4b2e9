"""Found by a flaky server test (`test_overload_gets_429_and_nothing_is_lost`, all 10 requests answered 200 once):
the in-flight limit was checked against the streams the engine thread had registered, so a burst of submissions
on the event loop all passed the check before the first one was registered. Fixed when `_submit` takes a slot
under a lock before handing the request over (given back on refusal or at the terminal event)."""

import asyncio

import _common

from prism.engine.engine import Engine  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.serving.async_engine import AsyncEngine, Overloaded  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

engine = Engine(ensure_tiny_checkpoint())
served = AsyncEngine(engine, max_in_flight=2)
served.start()


async def one(i: int) -> str:
    prompt = engine.inputs.prepare_prompt(f"question {i}")
    try:
        async for _ in served.generate(f"r{i}", prompt, SamplingParams.greedy(max_tokens=8)):
            pass
        return "served"
    except Overloaded:
        return "refused"


async def burst() -> list[str]:
    return await asyncio.gather(*(one(i) for i in range(8)))


outcomes = asyncio.run(burst())
served.shutdown()
served_count = outcomes.count("served")
leaked = getattr(served, "_slots_taken", 0)  # the counter the fix added
_common.verdict(served_count == 2 and leaked == 0,
                f"a burst of 8 against a limit of 2: {served_count} served, {outcomes.count('refused')} refused, "
                "no slot left taken",
                f"a burst of 8 against a limit of 2: {served_count} served (slots still taken: {leaked})")
