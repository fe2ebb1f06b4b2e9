"""Engine events -> OpenAI responses: the non-streaming body, the SSE chunk sequence, usage and logprobs.

Owns the mapping from `RequestOutput` events (one engine request per choice) to what a client receives:
- text: a choice's content is the concatenation of its events' `new_text` (the detokenizer already
  guarantees deltas never split a character), streamed as one chunk per event that carries anything;
- finish reasons: STOP -> "stop", LENGTH -> "length"; ABORT and ERROR never become a finish_reason
  (`RequestFailedError`, which the server turns into an error response or an SSE error event);
- logprobs: one entry per generated token with its exact bytes (`engine.detokenize.ByteLevelVocab`), -inf -> -9999;
- usage: the prompt (and its prefix-cache hits) counted once, completion tokens summed over choices.
Shapes and serialization are `protocol`'s; this module only fills them.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Literal

from ..engine.request import FinishReason, RequestOutput, TokenLogprobs
from .responses import (
    SSE_DONE,
    ChatCompletionChunk,
    ChatCompletionChunkWithUsage,
    ChatCompletionResponse,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    DeltaMessage,
    PromptTokensDetails,
    RequestAborted,
    RequestFailedError,
    ResponseMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    error_body,
    sse,
)

MIN_LOGPROB = -9999.0  # what OpenAI reports for -inf (JSON has no infinity)
TokenBytes = Callable[[int], bytes]


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def openai_finish_reason(
    reason: FinishReason | None, error: str | None = None
) -> Literal["stop", "length"] | None:
    """STOP -> "stop", LENGTH -> "length", None -> None; ERROR raises `RequestFailedError`, ABORT its
    `RequestAborted` (a 503: only shutting down aborts a request whose client is still there)."""
    if reason is None:
        return None
    if reason is FinishReason.STOP:
        return "stop"
    if reason is FinishReason.LENGTH:
        return "length"
    if reason is FinishReason.ABORT:
        raise RequestAborted()
    raise RequestFailedError(error or "the request could not be served", status=500)


def finite_logprob(x: float) -> float:
    return x if math.isfinite(x) and x >= MIN_LOGPROB else MIN_LOGPROB


def token_logprobs(entries: Sequence[TokenLogprobs], token_bytes: TokenBytes) -> list[TokenLogprob]:
    """Engine logprobs -> OpenAI's per-token entries (token text is its bytes, invalid UTF-8 replaced)."""

    def top(token_id: int, logprob: float) -> TopLogprob:
        raw = token_bytes(token_id)
        return TopLogprob(
            token=raw.decode("utf-8", "replace"), logprob=finite_logprob(logprob), bytes=list(raw)
        )

    out = []
    for e in entries:
        chosen = top(e.token_id, e.logprob)
        out.append(
            TokenLogprob(
                token=chosen.token,
                logprob=chosen.logprob,
                bytes=chosen.bytes,
                top_logprobs=[top(t, lp) for t, lp in e.top],
            )
        )
    return out


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def usage_from_outputs(finals: Sequence[RequestOutput], per_prompt: int | None = None) -> Usage:
    """Usage of one completion from the last event of each choice: each prompt (and its cache hits) once, as its
    first choice saw it; completion tokens summed over the choices. `per_prompt`: choices per prompt, in prompt
    order (a text completion of several prompts); default, all of one prompt."""
    if not finals:
        raise ValueError("usage needs the final event of at least one choice")
    firsts = finals[:: per_prompt or len(finals)]
    return make_usage(sum(f.prompt_tokens for f in firsts), sum(f.completion_tokens for f in finals),
                      sum(f.cached_tokens for f in firsts))


def _logprobs_of(events: Sequence[RequestOutput], token_bytes: TokenBytes | None) -> ChoiceLogprobs | None:
    entries = [e for ev in events if ev.logprobs for e in ev.logprobs]
    if not any(ev.logprobs is not None for ev in events):
        return None
    if token_bytes is None:
        raise ValueError("token_bytes is needed to render logprobs")
    return ChoiceLogprobs(content=token_logprobs(entries, token_bytes))


def final_events(choices: Sequence[Sequence[RequestOutput]]) -> list[RequestOutput]:
    """Each choice's last event; ValueError if a choice has not finished."""
    for index, events in enumerate(choices):
        if not events or not events[-1].finished:
            raise ValueError(f"choice {index} has not finished")
    return [events[-1] for events in choices]


def build_response(
    completion_id: str,
    created: int,
    model: str,
    choices: Sequence[Sequence[RequestOutput]],
    token_bytes: TokenBytes | None = None,
) -> ChatCompletionResponse:
    """A non-streaming response from each choice's events in order (the last one finished)."""
    out, finals = [], final_events(choices)
    for index, (events, final) in enumerate(zip(choices, finals, strict=True)):
        reason = openai_finish_reason(final.finish_reason, final.error)
        message = ResponseMessage(content="".join(ev.new_text for ev in events))
        out.append(
            Choice(
                index=index, message=message, logprobs=_logprobs_of(events, token_bytes), finish_reason=reason
            )
        )
    return ChatCompletionResponse(
        id=completion_id, created=created, model=model, choices=out, usage=usage_from_outputs(finals)
    )


def chunk_from_output(
    completion_id: str,
    created: int,
    model: str,
    index: int,
    event: RequestOutput,
    token_bytes: TokenBytes | None = None,
    chunk_type: type[ChatCompletionChunk] = ChatCompletionChunk,
) -> ChatCompletionChunk | None:
    """The chunk for one engine event of choice `index`, or None when it carries nothing to send. `chunk_type`:
    `ChatCompletionChunkWithUsage` in a stream that asked for usage."""
    reason = openai_finish_reason(event.finish_reason, event.error) if event.finished else None
    logprobs = _logprobs_of([event], token_bytes) if event.logprobs else None
    if not event.new_text and reason is None and logprobs is None:
        return None
    delta = DeltaMessage(content=event.new_text if (event.new_text or logprobs) else None)
    choice = ChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)
    return chunk_type(id=completion_id, created=created, model=model, choices=[choice])


class ChatCompletionStream:
    """SSE bytes of one streamed completion: `start()`, `on_output(index, event)` per engine event,
    `finish()` once every choice has finished (usage chunk if asked, then [DONE]), or `error()` instead."""

    def __init__(
        self,
        model: str,
        *,
        n: int = 1,
        include_usage: bool = False,
        token_bytes: TokenBytes | None = None,
        completion_id: str | None = None,
        created: int | None = None,
    ) -> None:
        self.id = completion_id or new_completion_id()
        self.created = int(time.time()) if created is None else created
        self.model = model
        self.include_usage = include_usage
        self._token_bytes = token_bytes
        self._finals: list[RequestOutput | None] = [None] * n

    def start(self) -> bytes:
        """The first chunk of every choice: role "assistant", empty content (what OpenAI sends first)."""
        choices = [
            ChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(len(self._finals))
        ]
        return b"".join(
            sse(self._chunk_type(id=self.id, created=self.created, model=self.model, choices=[c]))
            for c in choices
        )

    def on_output(self, index: int, event: RequestOutput) -> bytes:
        """SSE bytes for one event (b"" when it carries nothing); raises `RequestFailedError` on ERROR/ABORT."""
        if not 0 <= index < len(self._finals) or self._finals[index] is not None:
            raise ValueError(f"choice {index} is out of range or already finished")
        chunk = chunk_from_output(self.id, self.created, self.model, index, event, self._token_bytes,
                                  self._chunk_type)
        if event.finished:
            self._finals[index] = event
        return b"" if chunk is None else sse(chunk)

    @property
    def _chunk_type(self) -> type[ChatCompletionChunk]:
        return ChatCompletionChunkWithUsage if self.include_usage else ChatCompletionChunk

    @property
    def finished(self) -> bool:
        return all(f is not None for f in self._finals)

    def finish(self) -> bytes:
        if not self.finished:
            raise ValueError("finish() before every choice finished")
        tail = b""
        if self.include_usage:
            usage = usage_from_outputs([f for f in self._finals if f is not None])
            tail = sse(
                ChatCompletionChunk(
                    id=self.id, created=self.created, model=self.model, choices=[], usage=usage
                )
            )
        return tail + SSE_DONE

    @staticmethod
    def error(status: int, message: str) -> bytes:
        """An error event then [DONE]: how a stream that already sent 200 reports a failure."""
        return sse(error_body(status, message)) + SSE_DONE
