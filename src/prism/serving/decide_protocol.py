"""`POST /v1/decide`: one material (chat messages with images/text) and several questions, answered as
probabilities. Request and response schema, strict like the chat schema."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..decision.questions import Answer, Question, QuestionError
from ..decision.thinking import ThinkingConfig
from .protocol import ChatMessage, ProtocolError, describe_validation_errors


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class DecideQuestion(_In):
    type: Literal["choice", "yes_no", "score"]
    text: str = Field(min_length=1)
    options: list[str] | None = None
    levels: list[int] | None = None
    temperature: float = Field(default=1.0, gt=0)

    def to_question(self) -> Question:
        return Question(self.type, self.text, tuple(self.options or ()), tuple(self.levels or ()), self.temperature)


class DecideThinking(_In):
    gate: float = Field(default=0.6, ge=0, le=1)
    max_tokens: int = Field(default=128, ge=1, le=4096)
    temperature: float = Field(default=0.7, ge=0)
    seed: int = Field(default=0, ge=0, le=2**63 - 1)

    def to_config(self) -> ThinkingConfig:
        return ThinkingConfig(self.gate, self.max_tokens, self.temperature, self.seed)


class DecideRequest(_In):
    model: str
    material: list[ChatMessage] = Field(min_length=1)
    questions: list[DecideQuestion] = Field(min_length=1, max_length=64)
    thinking: DecideThinking | None = None


class DecideAnswer(BaseModel):
    index: int
    type: str
    probabilities: dict[str, float]
    answer: str
    confidence: float
    expected_value: float | None = None
    thought: bool = False
    thinking_tokens: int = 0


class DecideUsage(BaseModel):
    """Sums over every engine request the decide made but its material's (whose tokens each question's prompt holds):
    each readout, group and final round, reasoning and re-read (`Answer`'s usage)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    questions: int


class DecideResponse(BaseModel):
    id: str
    object: Literal["decision"] = "decision"
    created: int
    model: str
    answers: list[DecideAnswer]
    usage: DecideUsage


def parse_decide_request(body: bytes | str | Mapping[str, Any]) -> tuple[DecideRequest, list[Question]]:
    """Validate a body (raw JSON, parsed and checked in one pass as the chat body is, so that no body, however
    deeply nested, raises anything but a ValidationError, or a parsed dict); raises ProtocolError (400) naming the
    field."""
    try:
        if isinstance(body, (bytes, str)):
            request = DecideRequest.model_validate_json(body)
        else:
            request = DecideRequest.model_validate(dict(body))
    except ValidationError as error:
        message, param = describe_validation_errors(error.errors())
        raise ProtocolError(message, param=param) from error
    questions = []
    for i, q in enumerate(request.questions):
        try:
            questions.append(q.to_question())
        except QuestionError as error:
            raise ProtocolError(f"questions[{i}]: {error}", param=f"questions[{i}]") from error
    return request, questions


def decide_response(decision_id: str, created: int, model: str, answers: list[Answer]) -> DecideResponse:
    return DecideResponse(
        id=decision_id,
        created=created,
        model=model,
        answers=[
            DecideAnswer(index=a.index, type=a.kind, probabilities=a.probabilities, answer=a.answer,
                         confidence=a.confidence, expected_value=a.expected_value, thought=a.thought,
                         thinking_tokens=a.thinking_tokens)
            for a in answers
        ],
        usage=DecideUsage(prompt_tokens=sum(a.prompt_tokens for a in answers),
                          completion_tokens=sum(a.completion_tokens for a in answers),
                          cached_tokens=sum(a.cached_tokens for a in answers), questions=len(answers)),
    )
