"""The OpenAI legacy text-completions API (`POST /v1/completions`): a raw prompt, no chat template.

Owns, for this endpoint, "a request either validates or is a 4xx naming the field" and the response shapes:
- a prompt is a string, a list of strings, a list of token ids or a list of such lists; text only (a media
  placeholder is refused by the input processor: pictures go through /v1/chat/completions);
- choices are numbered prompt by prompt, choice j of prompt i at index i * n + j (as OpenAI and vLLM number them);
- `max_tokens` defaults to 16 (OpenAI's default), cut to what the context holds; an explicit one it cannot hold is a
  400, as in the chat endpoint;
- logprobs in the legacy layout: `tokens`, `token_logprobs`, `top_logprobs` (the k most likely tokens and the
  chosen one, by their text: tokens of equal text are one entry, as in OpenAI's and vLLM's, listed with the most
  likely one's logprob, and the chosen token's text with its own: `token_logprobs[i] == top_logprobs[i][tokens[i]]`)
  and `text_offset` (each token's character offset in the choice's text: `LegacyLogprobs`);
- `echo` puts the prompt's text before each choice's: its whole characters, the choice's text then starting with the
  character a prompt of token ids ends inside (completed by the first tokens, or cut, as U+FFFD), so that the two are
  the decode of prompt and completion together (vLLM echoes that U+FFFD, then the completed character). Refused with
  a message: `echo` with logprobs (it needs the prompt's own logprobs, which the engine does not compute), `suffix`,
  and a `best_of` other than n.
Sampling fields, their defaults and the no-op fields are `protocol.SamplingFields`, shared with chat.
"""

from __future__ import annotations

import codecs
import time
import uuid
from collections.abc import Collection, Sequence
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ..engine.detokenize import utf8_decoder
from ..engine.request import RequestOutput, TokenLogprobs
from ..engine.sampling import MAX_LOGPROBS, SamplingParams
from .protocol import FieldError, ProtocolError, SamplingFields, parse_request
from .responses import SSE_DONE, OutputModel, Usage, sse
from .stream import (
    ChatCompletionStream,
    TokenBytes,
    final_events,
    finite_logprob,
    openai_finish_reason,
    usage_from_outputs,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
MAX_PROMPTS = 128  # prompts in one request (each is one engine request per choice)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _prompt_list(value: Any) -> list[str | list[int]]:
    """The request's prompts, each a string or a list of token ids (ValueError naming the accepted forms)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(_is_token_id(v) for v in value):
            return [list(value)]
        if all(isinstance(v, list) and v and all(_is_token_id(t) for t in v) for v in value):
            return [list(v) for v in value]
    raise ValueError("prompt must be a string, a non-empty list of strings, a non-empty list of token ids "
                     "(non-negative integers) or a list of such lists")


class CompletionRequest(SamplingFields):
    """POST /v1/completions body."""

    prompt: Any
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any, info: ValidationInfo) -> list[str | list[int]]:
        """Sizes first (`info.context`: the server's `max_prompt_tokens` and `max_prompt_chars`), before any
        per-element check: a body of 31 M token ids took 10 s of the event loop to refuse."""
        limits = info.context or {}
        max_tokens, max_chars = limits.get("max_prompt_tokens"), limits.get("max_prompt_chars")
        several = isinstance(value, list) and bool(value) and isinstance(value[0], (str, list))
        items = value if several else [value]  # a string, or one prompt's token ids
        if len(items) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(items)}")
        for i, p in enumerate(items):
            if max_tokens is not None and isinstance(p, list) and len(p) > max_tokens:
                raise ValueError(f"prompt {i} has {len(p)} token ids; the limit is {max_tokens}")
            if max_chars is not None and isinstance(p, str) and len(p) > max_chars:
                raise ValueError(f"prompt {i} has {len(p)} characters: more than {max_tokens} tokens, the limit")
        prompts = _prompt_list(value)
        if any(p == "" for p in prompts):
            raise ValueError("a prompt must not be empty")
        return prompts

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise FieldError("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.num_choices:
            raise FieldError("best_of is not supported by this server except equal to n", "best_of")
        if self.echo and self.logprobs is not None:
            raise FieldError("echo with logprobs is not supported: the prompt's logprobs are not computed", "echo")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        return self.prompt

    def params_for(self, prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """Sampling parameters for one prompt: an explicit max_tokens the context cannot hold is a `ProtocolError`;
        the default is cut to what it holds."""
        room = max_model_len - prompt_tokens
        if self.max_tokens is not None and self.max_tokens > room:
            raise ProtocolError(f"this model's context is {max_model_len} tokens; the prompt has {prompt_tokens} and "
                                f"max_tokens asks for {self.max_tokens} more", param="max_tokens")
        return self.sampling_params(self.max_tokens or max(1, min(DEFAULT_MAX_TOKENS, room)), self.logprobs)


def parse_completion_request(body: bytes | str | dict[str, Any], max_prompt_tokens: int | None = None,
                             max_prompt_chars: int | None = None) -> CompletionRequest:
    """The body as a `CompletionRequest`; prompts past the limits (when given) are refused before anything else
    about them is checked."""
    return parse_request(CompletionRequest, body,
                         {"max_prompt_tokens": max_prompt_tokens, "max_prompt_chars": max_prompt_chars})


# ----------------------------------------------------------------------------------------- responses
class CompletionLogprobs(OutputModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(OutputModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(OutputModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    OMIT_IF_NONE = frozenset({"usage"})


class CompletionChunkWithUsage(CompletionResponse):
    """A chunk of a stream that asked for usage: "usage" on every chunk, null until the last one's (as OpenAI)."""

    OMIT_IF_NONE = frozenset()


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


class LegacyLogprobs:
    """Accumulates one choice's logprobs in the legacy layout. `text_offset[i]`: the number of characters of the
    choice's text (after `offset`, the echo's) made wholly of bytes before token i. A character ends in the token
    holding its last byte, so a character split over tokens counts where it completes (a token inside it has the
    offset of that character), and an invalid run of bytes (one U+FFFD) counts before the token whose first byte cuts
    it; a token without bytes in the text (a special token it leaves out) comes after the characters known complete
    when it came. So each token's own text starts at its offset when that text is whole characters. `tail`: the bytes
    of the prompt's incomplete last character, which the text starts by completing (`engine.detokenize`). (Past a
    stop string, inside the last token, the offsets go beyond the cut text.) vLLM's offsets are the running sum of
    each token's own text, which counts a split character once per byte token: they point past the text."""

    def __init__(self, token_bytes: TokenBytes, offset: int, skipped: Collection[int] = (), tail: bytes = b"") -> None:
        self.token_bytes = token_bytes
        self.offset = offset
        self.skipped = skipped
        self._utf8 = utf8_decoder(tail)

    def _text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", "replace")

    def _top(self, entry: TokenLogprobs, text: str) -> dict[str, float]:
        """One token's `top_logprobs`: its alternatives by text, each text with its most likely token's logprob
        (byte tokens of a split character all read U+FFFD), and the chosen token under its own text with its own."""
        top: dict[str, float] = {}
        for token_id, logprob in entry.top:  # best first
            top.setdefault(self._text(token_id), finite_logprob(logprob))
        top[text] = finite_logprob(entry.logprob)
        return top

    def _cut_before(self, raw: bytes) -> int:
        """1 when the decoder holds an incomplete character that the first byte of `raw` cannot continue: that byte
        ends it as a U+FFFD before `raw`'s own text (the decoder releases it only with `raw`)."""
        held = self._utf8.held
        if not held or not raw:
            return 0
        try:
            codecs.utf_8_decode(held + raw[:1], "strict", False)  # an incomplete character is no error, a cut one is
        except UnicodeDecodeError:
            return 1
        return 0

    def of(self, event: RequestOutput) -> CompletionLogprobs:
        tokens, chosen, tops, offsets = [], [], [], []
        for entry in event.logprobs or ():
            raw = self.token_bytes(entry.token_id)
            text = raw.decode("utf-8", "replace")
            tokens.append(text)
            chosen.append(finite_logprob(entry.logprob))
            tops.append(self._top(entry, text))
            in_text = b"" if entry.token_id in self.skipped else raw
            offsets.append(self.offset + self._cut_before(in_text))
            self.offset += len(self._utf8.decode(in_text))
        return CompletionLogprobs(tokens=tokens, token_logprobs=chosen, top_logprobs=tops, text_offset=offsets)


def _merged(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=[t for p in parts for t in p.tokens],
                              token_logprobs=[t for p in parts for t in p.token_logprobs],
                              top_logprobs=[t for p in parts for t in p.top_logprobs],
                              text_offset=[t for p in parts for t in p.text_offset])


class CompletionRenderer:
    """Engine events of one completion (`len(echoes)` choices) -> the response body, or its SSE bytes:
    `start()`, `on_output(index, event)` per event, `finish()` (usage chunk if asked, [DONE]) or `error()`.
    `echoes[i]`: the text choice i starts with (its prompt's under `echo`, else ""). `skipped_tokens`: the special
    tokens a choice's text leaves out, `prompt_tails[i]` the bytes of the incomplete character choice i's prompt ends
    with (b"" for each if not given): both for `text_offset`."""

    def __init__(self, model: str, echoes: Sequence[str], n: int, *, include_usage: bool = False,
                 token_bytes: TokenBytes | None = None, skipped_tokens: Collection[int] = (),
                 prompt_tails: Sequence[bytes] | None = None, completion_id: str | None = None) -> None:
        self.id = completion_id or new_completion_id()
        self.created = int(time.time())
        self.model = model
        self.n = n
        self.include_usage = include_usage
        self.echoes = list(echoes)
        tails = [b""] * len(echoes) if prompt_tails is None else prompt_tails
        self._logprobs = ([LegacyLogprobs(token_bytes, len(e), skipped_tokens, tail)
                           for e, tail in zip(echoes, tails, strict=True)] if token_bytes else None)
        self._finals: list[RequestOutput | None] = [None] * len(echoes)

    @property
    def _chunk_type(self) -> type[CompletionResponse]:
        return CompletionChunkWithUsage if self.include_usage else CompletionResponse

    def _chunk(self, choice: CompletionChoice) -> bytes:
        return sse(self._chunk_type(id=self.id, created=self.created, model=self.model, choices=[choice]))

    def start(self) -> bytes:
        """Under `echo`, each choice's prompt text first."""
        return b"".join(self._chunk(CompletionChoice(index=i, text=e)) for i, e in enumerate(self.echoes) if e)

    def on_output(self, index: int, event: RequestOutput) -> bytes:
        """SSE bytes for one event (b"" when it carries nothing); `RequestFailedError` on ERROR / ABORT."""
        if not 0 <= index < len(self._finals) or self._finals[index] is not None:
            raise ValueError(f"choice {index} is out of range or already finished")
        reason = openai_finish_reason(event.finish_reason, event.error) if event.finished else None
        if event.finished:
            self._finals[index] = event
        logprobs = self._logprobs[index].of(event) if self._logprobs and event.logprobs else None
        if not event.new_text and reason is None and logprobs is None:
            return b""
        return self._chunk(CompletionChoice(index=index, text=event.new_text, logprobs=logprobs, finish_reason=reason))

    def finish(self) -> bytes:
        finals = [f for f in self._finals if f is not None]
        if len(finals) != len(self._finals):
            raise ValueError("finish() before every choice finished")
        usage = b""
        if self.include_usage:
            usage = sse(CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                           usage=usage_from_outputs(finals, self.n)))
        return usage + SSE_DONE

    error = staticmethod(ChatCompletionStream.error)  # the same error event then [DONE]

    def response(self, choices: Sequence[Sequence[RequestOutput]]) -> CompletionResponse:
        """The non-streaming body from each choice's events in order (the last one finished)."""
        out, finals = [], final_events(choices)
        for index, (events, final) in enumerate(zip(choices, finals, strict=True)):
            reason = openai_finish_reason(final.finish_reason, final.error)
            logprobs = None
            if self._logprobs is not None:
                logprobs = _merged([self._logprobs[index].of(e) for e in events])
            text = self.echoes[index] + "".join(e.new_text for e in events)
            out.append(CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason))
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=out,
                                  usage=usage_from_outputs(finals, self.n))
