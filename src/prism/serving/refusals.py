"""Owns *a refusal is a 4xx with its own message, anything else a 500 naming only a request id*: the status each
refusal answers (`error_response`: 413, 404, 429, 503, the protocol's 400s; the server's own failures through
`internal_errors.py`), a body refused once it is known to exceed its limit (`read_body`) and an unknown model."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from ..engine.engine import EngineStopped
from ..media.errors import ImageTooLargeError
from .async_engine import Overloaded, ShuttingDown
from .body_deadline import BodyReadTimeout
from .internal_errors import internal_error_response
from .responses import RequestAborted, error_body, error_from_exception
from .server_state import ServerState


async def read_body(request: Request, state: ServerState) -> bytes:
    """The raw body, refused (413) as soon as it is known to exceed the limit, or (408) once it is late
    (`BodyReadTimeout`, raised by the reads: body_deadline.py)."""
    limit = state.settings.max_request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body has {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise TooLarge(f"the request body exceeds {limit} bytes")
    return bytes(body)


class TooLarge(ValueError):
    status = 413
    param = None


class NotFound(ValueError):
    status = 404
    param = "model"
    code = "model_not_found"


def model_not_found(model: str, state: ServerState) -> NotFound:
    return NotFound(f"the model {model!r} does not exist; this server serves {state.settings.served_model_name!r}")


def error_response(state: ServerState, error: Exception, where: str) -> Response:
    """A refusal's own error body, or for anything else (a 500) the internal error naming a request id, the failure
    logged under it (`where`: the endpoint or completion)."""
    if isinstance(error, ClientDisconnect):  # it left while sending its body: no one to answer, nothing failed
        return Response(status_code=499)
    if isinstance(error, Overloaded):
        status, body = 429, error_body(429, str(error))
    elif isinstance(error, (ShuttingDown, EngineStopped, RequestAborted)):
        status, body = 503, error_body(503, str(error))
    elif isinstance(error, ImageTooLargeError):  # includes decompression bombs
        status, body = 413, error_body(413, str(error))
    else:
        status, body = error_from_exception(error)
        if status >= 500:  # not a refusal: the server failed
            state.metrics.rejected.labels(status="500").inc()
            return internal_error_response(error, where)
    state.metrics.rejected.labels(status=str(status)).inc()
    # 429: retry later (the requests in flight finish in time); a 408's headers close the connection
    headers = {"Retry-After": "1"} if status == 429 else error.headers if isinstance(error, BodyReadTimeout) else None
    return JSONResponse(body, status_code=status, headers=headers)
