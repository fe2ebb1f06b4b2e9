"""Found by review (session 22): a decide forks one engine request per question; one needing more than the
server's `max_in_flight` was answered 429 "retry later", which no retry could ever satisfy, even on an idle
server. Fixed when such a submission is refused as a RequestError (400) naming the limit."""

import asyncio

import _common  # noqa: F401
from specs.spec_decision_liveness import engine_under_test  # noqa: E402

from prism.engine.engine import RequestError  # noqa: E402
from prism.serving.async_engine import AsyncEngine, Overloaded  # noqa: E402


async def submit_two(front: AsyncEngine):
    return await front._submit(("a", "b"), lambda engine: None)


front = AsyncEngine(engine_under_test().engine, max_in_flight=1)
try:
    asyncio.run(submit_two(front))
    ok, detail = False, "two requests admitted against a limit of one"
except RequestError as error:
    ok, detail = True, f"RequestError (400): {error}"
except Overloaded as error:
    ok, detail = False, f"Overloaded (429, retry later): {error}"
finally:
    front.shutdown(timeout=0)  # its thread never started
_common.verdict(ok, detail, detail)
