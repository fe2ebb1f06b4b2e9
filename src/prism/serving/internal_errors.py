"""What a client is told when the server itself fails: that it failed, and the request id under which the log has
the rest.

Owns *a 500 shows no internals*: every 500, whatever failed (the engine failing a request, a handler raising, a
response or a stream failing to render, an exception outside every handler), has the body
`internal_error_body(request_id)`: one fixed message naming a fresh request id, type "server_error", code
"internal_error"; the JSON response carries the id in `X-Request-Id` too, and a stream that fails after its 200 ends
with that body as its error event, then [DONE]. The failure itself is logged at ERROR under the same id: an
exception with its traceback; the engine's reason for failing a request as it gave it (the engine logged that
failure's traceback under its request ids, which start with the completion id logged here). Deliberate refusals
(4xx, and the 429 and 503 of a full or stopping server) keep their own messages: they are not answered here.
"""

from __future__ import annotations

import logging
import uuid

from fastapi.responses import JSONResponse

from .responses import RequestFailedError, error_body

log = logging.getLogger("prism.server")

REQUEST_ID_HEADER = "X-Request-Id"


def internal_error_message(request_id: str) -> str:
    return f"the server had an internal error while handling the request (request id {request_id} in its log)"


def internal_error_body(request_id: str) -> dict:
    return error_body(500, internal_error_message(request_id))


def report(failure: BaseException, where: str) -> str:
    """Log `failure` (what failed, `where`: the endpoint or the completion it served) under a fresh request id, which
    is returned."""
    request_id = f"req-{uuid.uuid4().hex}"
    if isinstance(failure, RequestFailedError):  # the engine's reason, not an exception of ours: no traceback
        log.error("request %s (%s) failed: %s", request_id, where, failure)
    else:
        log.error("request %s (%s) failed: %s: %s", request_id, where, type(failure).__name__, failure,
                  exc_info=failure)
    return request_id


def internal_error_response(failure: BaseException, where: str) -> JSONResponse:
    request_id = report(failure, where)
    return JSONResponse(internal_error_body(request_id), status_code=500, headers={REQUEST_ID_HEADER: request_id})


class InternalErrors:
    """ASGI middleware: an exception that escaped every handler before its response started is answered as any 500
    is (`internal_error_response`), not with the framework's plain-text one. One raised after the response started
    cannot be answered: it is re-raised, and the server logs it and closes the connection (the endpoints' streams
    end themselves with an error event before that can happen)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_watched(message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        except Exception as error:  # noqa: BLE001 - the last place a failure can become an answer
            if started:
                raise
            response = internal_error_response(error, f"{scope['method']} {scope['path']}")
            await response(scope, receive, send)
