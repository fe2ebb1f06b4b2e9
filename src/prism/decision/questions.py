"""Decision questions and their probability readout.

Owns what a question asks and how its answer is read: a question renders to one user turn, its answer
is one token among listed candidates (option letters, Yes/No, score levels), and the readout is the
softmax of the fp32 logits of those candidates only, at the branch's last position. Each candidate must
be exactly one token of the checkpoint's tokenizer, checked before anything runs.
"""

from __future__ import annotations

import math
import numbers
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["choice", "yes_no", "score"]
MAX_OPTIONS = len(string.ascii_uppercase)


class QuestionError(ValueError):
    """A question that cannot be asked (no options, too many, a candidate that is not one token...)."""


def integral(x) -> bool:
    """An integer to a user: Python's or numpy's (any `numbers.Integral`), but not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def listed_values(name: str, value) -> tuple:
    """A question's options or levels as a tuple: given as any ordered sequence (a list, a tuple, a range, a deque, an
    `array.array`...) or a one-dimensional array (numpy's, torch's: their items as Python values). A string is one
    value, not a sequence of one-character options, and so are bytes in any wrapper (a memoryview's items would be
    byte values); a set or a dict has no order to label its options A, B, C by."""
    if not isinstance(value, (str, bytes, bytearray, memoryview)):
        if isinstance(value, Sequence):
            return tuple(value)
        if getattr(value, "ndim", None) == 1 and callable(getattr(value, "tolist", None)):
            return tuple(value.tolist())
    raise QuestionError(f"{name} must be a list or another ordered sequence (or a one-dimensional array), got "
                        f"{type(value).__name__} {value!r}")


def finite_real(x) -> bool:
    """A finite number to a user: Python's or numpy's (any `numbers.Real`), but not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class Question:
    kind: Kind
    text: str
    options: tuple[str, ...] = ()  # choice: the option texts, labelled A, B, C... (more than 26: grouped rounds)
    levels: tuple[int, ...] = ()  # score: the allowed scores
    temperature: float = 1.0  # readout temperature (softmax over candidate logits / temperature)

    def __post_init__(self) -> None:
        for name in ("options", "levels"):
            object.__setattr__(self, name, listed_values(name, getattr(self, name)))
        if self.kind not in ("choice", "yes_no", "score"):
            raise QuestionError(f"question kind must be choice, yes_no or score, got {self.kind!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise QuestionError(f"a question needs text (a non-empty string), got {self.text!r}")
        if not all(isinstance(option, str) and option.strip() for option in self.options):
            raise QuestionError(f"options must be non-empty strings, got {list(self.options)!r}")
        if not all(integral(level) for level in self.levels):
            raise QuestionError(f"score levels must be integers, got {list(self.levels)!r}")
        object.__setattr__(self, "levels", tuple(int(level) for level in self.levels))  # (numpy's integers as Python's)
        if not (finite_real(self.temperature) and self.temperature > 0):
            raise QuestionError(f"temperature must be a positive number, got {self.temperature!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        if self.kind == "choice":
            if len(self.options) < 2:
                raise QuestionError("a choice question needs at least two options")
        elif self.options:
            raise QuestionError(f"options are only for choice questions, not {self.kind}")
        if self.kind == "score":
            if len(self.levels) < 2 or len(set(self.levels)) != len(self.levels):
                raise QuestionError("a score question needs at least two distinct levels")
        elif self.levels:
            raise QuestionError(f"levels are only for score questions, not {self.kind}")

    @property
    def labels(self) -> tuple[str, ...]:
        """The answer strings, one token each."""
        if self.kind == "choice":
            if len(self.options) > MAX_OPTIONS:  # asked in grouped rounds; answers named by position
                return tuple(str(k + 1) for k in range(len(self.options)))
            return tuple(string.ascii_uppercase[: len(self.options)])
        if self.kind == "yes_no":
            return ("Yes", "No")
        return tuple(str(level) for level in self.levels)

    def render(self) -> str:
        """The user turn that asks this question."""
        if self.kind == "choice":
            lines = [option_line(label, option) for label, option in zip(self.labels, self.options, strict=True)]
            return f"{self.text}\n" + "".join(lines) + "Answer with the letter of the correct option only."
        if self.kind == "yes_no":
            return f"{self.text}\nAnswer Yes or No only."
        return f"{self.text}\nAnswer with one score from {', '.join(self.labels)} only."


def option_line(label: str, option: str) -> str:
    """A choice's option as its rendering shows it: a line of its own."""
    return f"{label}. {option}\n"


def candidate_token_ids(question: Question, encode) -> tuple[int, ...]:
    """The token id of each label; refuses a label the tokenizer splits into several tokens."""
    ids = []
    for label in question.labels:
        tokens = encode(label)
        if len(tokens) != 1:
            raise QuestionError(
                f"the answer {label!r} is {len(tokens)} tokens for this tokenizer; a readout needs exactly one"
            )
        ids.append(tokens[0])
    if len(set(ids)) != len(ids):
        raise QuestionError(f"two answers of {question.labels} share a token")
    return tuple(ids)


@dataclass
class Answer:
    """The readout of one question."""

    index: int
    kind: Kind
    probabilities: dict[str, float]
    answer: str
    confidence: float
    expected_value: float | None = None
    # Usage: the sums over every engine request asked for this question (each round of a grouped choice; a thinking
    # one's first readout, reasoning and re-read): their prompt tokens, those of them from the prefix cache, and the
    # tokens they generated (a readout generates none).
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    thought: bool = False  # gated thinking ran for this question
    thinking_tokens: int = 0  # the tokens its reasoning generated


def readout(logits: torch.Tensor, candidates: Sequence[int], temperature: float = 1.0) -> list[float]:
    """Softmax over the candidates' logits only (the rest of the vocabulary plays no part), in fp64. The best
    logit is subtracted before the division, so a temperature however small sends the others to -inf and the
    best to 0 (never inf - inf: NaN); fp64 keeps the division meaningful below fp32's smallest number."""
    picked = logits[torch.as_tensor(list(candidates), dtype=torch.long, device=logits.device)].double()
    return torch.softmax((picked - picked.max()) / temperature, dim=-1).tolist()


def make_answer(index: int, question: Question, probabilities: Sequence[float]) -> Answer:
    probs = dict(zip(question.labels, (float(p) for p in probabilities), strict=True))
    best = max(question.labels, key=lambda label: (probs[label], -question.labels.index(label)))
    expected = None
    if question.kind == "score":
        expected = sum(level * probs[str(level)] for level in question.levels)
    return Answer(index, question.kind, probs, best, probs[best], expected)
