"""Owns *nothing computes for no one*: a request whose client disconnected before its answer, or a round of requests
one of which failed, has its remaining work cancelled, and a cancelled wait on an engine request aborts that request
(its pages are released)."""

from __future__ import annotations

import asyncio

from fastapi import Request


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer: the work was cancelled."""


DISCONNECT_POLL_S = 0.25


async def until_disconnected(request: Request, work):
    """Await `work` (a coroutine), cancelling it if the client disconnects first (polled every DISCONNECT_POLL_S):
    the engine requests it was waiting on are aborted by their own cancellation paths, so a client that gave up
    does not keep its questions or choices computing to the end."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its cleanup (aborts) done before we return


async def all_or_none(coros: list) -> list:
    """asyncio.gather, but one failing cancels the others (their requests are aborted), rather than leaving them
    running for a client that already got its error."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
