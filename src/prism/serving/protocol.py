"""The OpenAI-compatible chat-completions request: validation into a typed `ChatCompletionRequest`.

Owns the rule "hostile input -> 4xx" at the schema level: a request either validates into a typed
`ChatCompletionRequest` whose every field is within what `SamplingParams` accepts, or fails with a
`ProtocolError` whose message and `param` name the offending field (OpenAI style: `messages[0].content[1].type`).
Validation is strict (no "1" for 1, no 1.5 for an int, no NaN): OpenAI rejects those too.

Accepted and ignored (the official client sends them or they change nothing here): `user`, `metadata`, `store`,
`service_tier`, `safety_identifier`, `prompt_cache_key`, `parallel_tool_calls`, `stream_options.include_obfuscation`,
`image_url.detail` (the checkpoint's processor decides the resolution), message `name`, `modalities=["text"]`,
`response_format={"type": "text"}`. Anything else unknown is refused.
Sampling as OpenAI: `frequency_penalty` and `presence_penalty` in [-2, 2] (over the output tokens), `logit_bias` as
a JSON object of token id (a string of digits) -> bias in [-100, 100] (an id outside the vocabulary is a 400 when the
engine takes the request). Extensions (vLLM names): `top_k`, `min_p`, `repetition_penalty` (> 0, over the prompt
and the output), `ignore_eos`, `stop_token_ids`, and the content part
`{"type": "video", "video": {"frames": [image URL, ...], "fps": float}}`.

The response, chunk and error shapes are in `prism.serving.responses`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..engine.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)


class ProtocolError(ValueError):
    """A request does not follow the schema; `param` names the field (e.g. "messages[0].content")."""

    status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# ------------------------------------------------------------------------------------------ requests
class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _by_key(key: str) -> Callable[[Any], str | None]:
    def tag(value: Any) -> str | None:
        found = value.get(key) if isinstance(value, Mapping) else getattr(value, key, None)
        return f"{key}={found}" if isinstance(found, str) else None

    return tag


def _str_or_list(value: Any) -> str | None:
    if isinstance(value, str):
        return "kind=str"
    return "kind=list" if isinstance(value, (list, tuple)) else None


def _text_or_parts(part: Any, what: str) -> Any:
    """`str | list[part]` as a tagged union, so a bad list reports the bad part, not 'not a string'."""
    return Annotated[
        Annotated[str, Tag("kind=str")] | Annotated[list[part], Field(min_length=1), Tag("kind=list")],
        Discriminator(
            _str_or_list,
            custom_error_type="content_type",
            custom_error_message=f"content must be a string or a non-empty list of {what}",
        ),
    ]


class TextPart(_In):
    type: Literal["text"]
    text: str


class ImageURL(_In):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None  # accepted, ignored


class ImageURLPart(_In):
    """An image by URL, with an optional `uuid` naming it (vLLM's convention). A part with a uuid and
    `"image_url": null` names an image sent earlier with that uuid: no pixels travel."""

    type: Literal["image_url"]
    image_url: ImageURL | None = None
    uuid: str | None = Field(default=None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _has_image_or_uuid(self) -> ImageURLPart:
        if self.image_url is None and self.uuid is None:
            raise ValueError("an image_url part needs image_url, or a uuid naming an image sent before")
        return self


class VideoURL(_In):
    url: str = Field(min_length=1)


class VideoURLPart(_In):
    type: Literal["video_url"]
    video_url: VideoURL


class VideoFrames(_In):
    frames: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    fps: float = Field(gt=0)


class VideoPart(_In):
    type: Literal["video"]
    video: VideoFrames


MediaPart = ImageURLPart | VideoURLPart | VideoPart
UserPart = Annotated[
    Annotated[TextPart, Tag("type=text")]
    | Annotated[ImageURLPart, Tag("type=image_url")]
    | Annotated[VideoURLPart, Tag("type=video_url")]
    | Annotated[VideoPart, Tag("type=video")],
    Discriminator(
        _by_key("type"),
        custom_error_type="content_part_type",
        custom_error_message="unknown content part type; expected text, image_url, video_url or video",
    ),
]


def _only_text_parts(value: Any) -> Any:
    # A one-member tagged union would say this too, but pydantic 2.11 refuses a Discriminator
    # on one type ("must be used with a Union type").
    if _by_key("type")(value) != "type=text":
        raise PydanticCustomError("content_part_type", "only text parts are allowed in system and assistant messages")
    return value


TextOnlyPart = Annotated[TextPart, BeforeValidator(_only_text_parts)]


SystemContent = _text_or_parts(TextOnlyPart, "text parts")
UserContent = _text_or_parts(UserPart, "content parts")


class SystemMessage(_In):
    role: Literal["system", "developer"]  # "developer" is OpenAI's newer name; rendered as system
    content: SystemContent  # type: ignore[valid-type]
    name: str | None = None  # accepted, ignored


class UserMessage(_In):
    role: Literal["user"]
    content: UserContent  # type: ignore[valid-type]
    name: str | None = None


class AssistantMessage(_In):
    role: Literal["assistant"]
    content: SystemContent  # type: ignore[valid-type]
    name: str | None = None
    # What the official client echoes back when a response message is appended to the history: ignored.
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    tool_calls: Annotated[list[Any], Field(max_length=0)] | None = None  # tools are not supported
    function_call: None = None
    audio: None = None


ChatMessage = Annotated[
    Annotated[SystemMessage, Tag("role=system")]
    | Annotated[SystemMessage, Tag("role=developer")]
    | Annotated[UserMessage, Tag("role=user")]
    | Annotated[AssistantMessage, Tag("role=assistant")],
    Discriminator(
        _by_key("role"),
        custom_error_type="message_role",
        custom_error_message="role must be one of system, developer, user, assistant (tools are not supported)",
    ),
]


class StreamOptions(_In):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted, ignored


class TextResponseFormat(_In):
    type: Literal["text"]


class FieldError(ValueError):
    """Raised inside a model validator: carries the field it is about (the root loc does not)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


RequestModel = TypeVar("RequestModel", bound=BaseModel)

# OpenAI's seed is a signed 64-bit integer: a negative seed means its two's complement (seed + 2**64).
MIN_SEED = -(2**63)


class SamplingFields(_In):
    """The fields both completion endpoints share: the model, sampling, stopping, streaming, and the no-op fields the
    official clients send."""

    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # extension: 0 / -1 disable
    min_p: float | None = Field(default=None, ge=0, le=1)  # extension: 0 disables
    repetition_penalty: float | None = Field(default=None, gt=0)  # extension: 1 disables
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (digits) -> bias
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    stop: (
        Annotated[
            Annotated[str, Tag("kind=str")] | Annotated[list[str], Tag("kind=list")],
            Discriminator(
                _str_or_list,
                custom_error_type="stop_type",
                custom_error_message="stop must be a string or a list of strings",
            ),
        ]
        | None
    ) = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # extension
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # extension
    user: str | None = None  # accepted, ignored

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        items = [stop] if isinstance(stop, str) else stop or []
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(items)}")
        for s in items:
            if not s:
                raise ValueError("stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} token ids may be biased, got {len(value)}")
        seen: dict[int, str] = {}
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:
                shown = key if len(key) <= 20 else key[:17] + "..."
                raise ValueError(f"keys are token ids written in digits (at most 10), got {shown!r}")
            if int(key) in seen:
                raise ValueError(f"token id {int(key)} is given twice ({seen[int(key)]!r} and {key!r})")
            seen[int(key)] = key
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {key} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {bias!r}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options is only allowed when stream is true", "stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        """A final usage-only chunk is wanted (streaming with stream_options.include_usage)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """OpenAI defaults (temperature 1, top_p 1); a negative seed as its unsigned 64-bit pattern."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=None if self.seed is None else self.seed % 2**64,
            stop=tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            n=self.num_choices,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
        )


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Accepted and ignored, or only their no-op value (see the module docstring).
    modalities: list[Literal["text"]] | None = None
    response_format: TextResponseFormat | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_combinations(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs requires logprobs to be true", "top_logprobs")
        return self

    def media_parts(self) -> list[MediaPart]:
        """Every image / video part of the request, in prompt order."""
        return [
            part
            for message in self.messages
            if isinstance(message, UserMessage) and isinstance(message.content, list)
            for part in message.content
            if not isinstance(part, TextPart)
        ]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """max_completion_tokens wins over max_tokens; logprobs=true -> SamplingParams.logprobs = top_logprobs (0 =
        only the chosen token's)."""
        return self.sampling_params(self.max_completion_tokens or self.max_tokens or default_max_tokens,
                                    (self.top_logprobs or 0) if self.logprobs else None)


def _param_path(loc: Sequence[int | str]) -> str | None:
    parts = [p for p in loc if not (isinstance(p, str) and "=" in p)]  # drop union tags (they hold "=")
    if parts and parts[0] == "body":  # FastAPI's RequestValidationError prefixes body fields
        parts = parts[1:]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def describe_validation_errors(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for pydantic / FastAPI validation errors: the first error, its field path first."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    ctx_error = (first.get("ctx") or {}).get("error")
    param = getattr(ctx_error, "param", None) or _param_path(first.get("loc", ()))
    msg = str(ctx_error) if isinstance(ctx_error, FieldError) else str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        msg = "unknown or unsupported field"
    value = first.get("input")
    if first.get("type") != "missing" and isinstance(value, (int, float, str, bool)):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        msg += f" (got {shown})"
    more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


def parse_request(model: type[RequestModel], body: bytes | str | Mapping[str, Any],
                  context: Mapping[str, Any] | None = None) -> RequestModel:
    """Validate a request body (raw JSON or a parsed dict) into `model` (`context`: what its validators may read);
    `ProtocolError` (400) naming the field if bad."""
    try:
        if isinstance(body, (bytes, str)):
            return model.model_validate_json(body, context=context)
        return model.model_validate(body, context=context)
    except ValidationError as exc:
        message, param = describe_validation_errors(exc.errors())
        raise ProtocolError(message, param) from None


def parse_chat_request(body: bytes | str | Mapping[str, Any]) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, body)
