"""The OpenAI-compatible response shapes: completion, chunk, model list, error JSON, server-sent events.

Output models serialize to OpenAI's JSON exactly: compact, with `null` where OpenAI sends null
(`finish_reason`, `logprobs`, error `param` / `code`) and omitted where OpenAI omits (empty delta fields, chunk
`usage` when absent). `prism.serving.stream` fills them from engine events.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, model_serializer

SSE_DONE = b"data: [DONE]\n\n"


class RequestFailedError(RuntimeError):
    """The engine ended a request with ERROR: a 500 (`internal_errors`); ABORT is its `RequestAborted`, a 503."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class RequestAborted(RequestFailedError):
    """The engine aborted a request whose client is still there: the server is shutting down (SIGTERM aborts every
    request first). A 503 the client may retry elsewhere, not a failure of the server's: logged, not as an error."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down: the request was aborted before it finished", status=503)


class OutputModel(BaseModel):
    """A response shape: the fields named in OMIT_IF_NONE are left out when None, the others sent as null."""

    model_config = ConfigDict(extra="forbid")
    OMIT_IF_NONE: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> Any:
        data = handler(self)
        for key in self.OMIT_IF_NONE:
            if data.get(key, 0) is None:
                del data[key]
        return data


class TopLogprob(OutputModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(OutputModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(OutputModel):
    content: list[TokenLogprob] | None


class ResponseMessage(OutputModel):
    role: Literal["assistant"] = "assistant"
    content: str | None


class Choice(OutputModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class PromptTokensDetails(OutputModel):
    cached_tokens: int = 0


class Usage(OutputModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    OMIT_IF_NONE = frozenset({"prompt_tokens_details"})


class ChatCompletionResponse(OutputModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class DeltaMessage(OutputModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    OMIT_IF_NONE = frozenset({"role", "content"})


class ChunkChoice(OutputModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(OutputModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    OMIT_IF_NONE = frozenset({"usage"})


class ChatCompletionChunkWithUsage(ChatCompletionChunk):
    """A chunk of a stream that asked for usage (`stream_options.include_usage`): as OpenAI sends them, every chunk
    carries "usage", null until the last one's."""

    OMIT_IF_NONE = frozenset()


class ModelCard(OutputModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prism"
    max_model_len: int | None = None  # extension (vLLM's name), omitted when unknown
    OMIT_IF_NONE = frozenset({"max_model_len"})


class ModelList(OutputModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(OutputModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OutputModel):
    error: ErrorDetail


_ERROR_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", None),  # as OpenAI types it; an unknown model's code is "model_not_found"
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    422: ("invalid_request_error", "unprocessable_entity"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "service_unavailable"),
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON `{"error": {"message", "type", "param", "code"}}` for an HTTP status."""
    kind, default_code = _ERROR_KINDS.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", None)
    )
    detail = ErrorDetail(message=message, type=kind, param=param, code=code or default_code)
    return ErrorResponse(error=detail).model_dump()


def error_from_exception(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(status, error body) for an exception: `status` / `param` / `code` attributes when it has them
    (ProtocolError, MediaURLError), 400 for any other ValueError, else 500 without internals (not even a
    RequestFailedError's: the engine's reason is for the log; the server answers a 500 with
    `internal_errors.internal_error_response`, which names a request id)."""
    status = getattr(exc, "status", None)
    if not isinstance(status, int):
        status = 400 if isinstance(exc, ValueError) else 500
    if status >= 500:
        return status, error_body(status, "internal server error")
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return status, error_body(status, message, getattr(exc, "param", None), getattr(exc, "code", None))


def sse(obj: BaseModel | Mapping[str, Any]) -> bytes:
    """One server-sent event `data: {compact json}\\n\\n`."""
    if isinstance(obj, BaseModel):
        payload = obj.model_dump_json()
    else:
        payload = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return b"data: " + payload.encode("utf-8") + b"\n\n"
