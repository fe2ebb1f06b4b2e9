"""The request body's deadline: a client that sends its headers, then withholds or trickles its body, holds a
connection and a handler for at most `ServerSettings.body_read_timeout_s` (slowloris).

Owns *a body arrives in time, or its request is a 408 that leaves nothing behind*: the whole body must have arrived
within the timeout of the app's first read of it (a deadline, not a wait per read, which a byte now and then would
pass). A read that would pass it raises `BodyReadTimeout` in the reader instead of waiting on. The endpoints read the
whole body before they parse, resolve media or submit anything (`app._read_body`), so nothing exists yet when they
answer it as a refusal: a 408 with OpenAI's error body and `Connection: close` (the rest of the body may still come,
and must not be read as the next request); any other reader gets the same answer from the HTTP-error handler.
Reads once the body is in (a response watching for its client's disconnect) are not timed; a request pays one timer
per read of its body, nothing more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.exceptions import HTTPException


class BodyReadTimeout(HTTPException):
    """The body was not in by its deadline (an HTTPException, so that whatever reads it, the answer is a 408)."""

    status = 408  # what `error_from_exception` reads
    param = None

    def __init__(self, timeout_s: float) -> None:
        self.message = f"the request body did not arrive within {timeout_s:g} s; send it whole, without pauses"
        super().__init__(408, self.message, headers={"Connection": "close"})


class BodyDeadline:
    """ASGI middleware: the app's reads of an HTTP request's body end by the deadline (`timeout_s()`: the current
    setting, read per request), or raise `BodyReadTimeout`."""

    def __init__(self, app, timeout_s: Callable[[], float]) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        timeout_s, deadline, body_in = self.timeout_s(), None, False

        async def receive_in_time():
            nonlocal deadline, body_in
            if body_in:
                return await receive()
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyReadTimeout(timeout_s) from None
            body_in = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_in_time, send)
