"""The request body's deadline: a client that sends its headers, then withholds or trickles its body, holds a
connection and a handler for at most `ServerSettings.body_read_timeout_s` (slowloris).

Owns *a body arrives in time, or its request is a 408 that leaves nothing behind*: the body must arrive within the
timeout of the app's first read of it, plus one second per `MIN_BODY_BYTES_PER_S` bytes received (a deadline, not a
wait per read, which a byte now and then would pass; the credit lets a large body in over a slow link, 64 MiB at 1
Mbit/s, while a trickle earns next to nothing). A read that would pass it raises `BodyReadTimeout` in the reader
instead of waiting on. The endpoints read the
whole body before they parse, resolve media or submit anything (`refusals.read_body`), so nothing exists yet when they
answer it as a refusal: a 408 with OpenAI's error body and `Connection: close` (the rest of the body may still come,
and must not be read as the next request); any other reader gets the same answer from the HTTP-error handler.
Reads once the body is in (a response watching for its client's disconnect) are not timed; a request pays one timer
per read of its body, nothing more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.exceptions import HTTPException

# A client sending at least this fast never meets its deadline (128 KiB/s: 1 Mbit/s).
MIN_BODY_BYTES_PER_S = 128 * 1024


class BodyReadTimeout(HTTPException):
    """The body was not in by its deadline (an HTTPException, so that whatever reads it, the answer is a 408)."""

    status = 408  # what `error_from_exception` reads
    param = None

    def __init__(self, timeout_s: float) -> None:
        self.message = (f"the request body did not arrive within {timeout_s:g} s (plus 1 s per "
                        f"{MIN_BODY_BYTES_PER_S // 1024} KiB received); send it whole, without pauses")
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
        timeout_s, start, received, body_in = self.timeout_s(), None, 0, False

        async def receive_in_time():
            nonlocal start, received, body_in
            if body_in:
                return await receive()
            if start is None:
                start = asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout_at(start + timeout_s + received / MIN_BODY_BYTES_PER_S):
                    message = await receive()
            except TimeoutError:
                raise BodyReadTimeout(timeout_s) from None
            received += len(message.get("body", b""))
            body_in = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_in_time, send)
