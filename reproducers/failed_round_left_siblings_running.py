"""Found by review (session 22): a decide's readout and thinking rounds awaited their requests with
`asyncio.gather`; when one failed (e.g. 429: another client took a slot between rounds) the client got its error
and the siblings ran on to their ends, holding their slots. Fixed when a round is all or none (`cancellation.all_or_none`:
the first failure cancels the others, whose cancellation aborts their requests)."""

import asyncio

import _common  # noqa: F401

from prism.serving import cancellation  # noqa: E402

still_running = []


async def sibling() -> None:
    await asyncio.sleep(2)
    still_running.append("ran to its end")


async def failing() -> None:
    await asyncio.sleep(0.01)
    raise RuntimeError("3 requests in flight (limit 3); retry later")


async def round_then_wait() -> None:
    gather = getattr(cancellation, "all_or_none", None) or (lambda coros: asyncio.gather(*coros))
    try:
        await gather([sibling(), failing()])
    except RuntimeError:
        pass
    await asyncio.sleep(2.5)  # the client already has its error; does the sibling still run?


asyncio.run(round_then_wait())
_common.verdict(not still_running, "a failed round cancelled its sibling", "the sibling ran on after the round failed")
