"""Per-request sampling parameters: one frozen, validated value object.

Owns the *meaning* of every sampling knob (OpenAI / vLLM conventions) and the rule that a bad value is
refused at construction with a `SamplingParamsError` (a `ValueError`, so serving maps it to a 4xx):
no request with a NaN temperature or an empty stop string ever reaches the sampler.

Conventions:
- `temperature == 0` (or below `GREEDY_TEMPERATURE_EPS`) means greedy; top-k / top-p / seed then do nothing.
  Tiny positive temperatures are treated as greedy because `logits / 1e-9` overflows fp32 to inf.
- `top_k` of 0 or -1 disables top-k; `top_p == 1.0` disables nucleus filtering.
- `logprobs = None` returns nothing extra; `logprobs = k` (0..20) returns the chosen token's logprob plus the
  k most likely alternatives (vLLM semantics: 0 = only the chosen token).
- `stop` strings are matched on the detokenized text and excluded from it; `stop_token_ids` end the
  request without their text; EOS does too unless `ignore_eos`.
- Logit adjustments (`engine/penalties.py`), on the raw logits before temperature, in this order:
  `logit_bias` (OpenAI: token id -> bias in [-100, 100], added), `repetition_penalty` (vLLM / HF, > 0, 1 = off:
  each token of the prompt or the output so far has its logit divided by it when positive, multiplied when not),
  `frequency_penalty` and `presence_penalty` (OpenAI, in [-2, 2], 0 = off: over the output tokens only,
  logit -= frequency * count + presence * (count > 0)). Greedy takes the argmax of the adjusted logits.
- `min_p` (in [0, 1], 0 = off) drops the tokens whose probability after temperature is below `min_p` times the
  most likely token's.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

import numpy as np

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# A stop string is held back from the stream while it may still be completing: bound the hold-back.
MAX_STOP_STRING_CHARS = 256
MAX_N = 128
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts unsigned 64-bit seeds
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # |a logit_bias value| (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024  # entries in one request's logit_bias: each costs host work on every step


class SamplingParamsError(ValueError):
    """A sampling parameter has a bad type or value (the message names the field and the value)."""


class SamplerError(ValueError):
    """The sampler's inputs disagree (shapes, lengths, dtypes, a seeded request without a generator, a penalized one
    without its token history, a token id outside the vocabulary)."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request (validated on construction)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # token id -> bias; given as a mapping (or pairs), kept as (id, bias) pairs sorted by id (hashable, frozen)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Derived on construction (read for every row of every step: an attribute, not a property):
    # a repetition, frequency or presence penalty is on (the row's token history is read) ...
    has_penalties: bool = field(default=False, init=False, repr=False, compare=False)
    # ... or a logit_bias: the logits are changed before sampling.
    adjusts_logits: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Normalise the forms callers naturally pass (a single stop string, lists) before validating.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, list):
            stop = tuple(stop)
        object.__setattr__(self, "stop", stop)
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # numpy's scalars (np.int64(5), np.float32(0.7)) as the Python numbers they are, not refused as non-numbers
        for name in ("max_tokens", "top_k", "seed", "logprobs", "n"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
                object.__setattr__(self, name, int(value))
        if isinstance(self.stop_token_ids, tuple) and all(isinstance(t, numbers.Integral) for t in self.stop_token_ids):
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
                object.__setattr__(self, name, float(value))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        self.validate()
        penalized = self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        object.__setattr__(self, "has_penalties", penalized)
        object.__setattr__(self, "adjusts_logits", penalized or bool(self.logit_bias))

    def validate(self) -> SamplingParams:
        """Raise `SamplingParamsError` for the first bad field; return self when all are valid."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):  # NaN fails the comparison too
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError(
                f"top_k must be an integer >= 1, or 0 / -1 to disable, got {self.top_k!r}"
            )
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed <= MAX_SEED)):
            raise SamplingParamsError(f"seed must be None or an integer in [0, 2**64 - 1], got {self.seed!r}")
        self._validate_stop()
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not (0 <= self.logprobs <= MAX_LOGPROBS)
        ):
            raise SamplingParamsError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if not _is_int(self.n) or not (1 <= self.n <= MAX_N):
            raise SamplingParamsError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        self._validate_logit_adjustments()
        return self

    def _validate_logit_adjustments(self) -> None:
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):  # NaN fails the comparison too
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p!r}")
        rep = self.repetition_penalty
        if not _is_real(rep) or not math.isfinite(rep) or rep <= 0:
            raise SamplingParamsError(f"repetition_penalty must be a finite number > 0 (1 = off), got {rep!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not (-MAX_PENALTY <= value <= MAX_PENALTY):
                raise SamplingParamsError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not isinstance(self.logit_bias, tuple):
            raise SamplingParamsError(
                f"logit_bias must be a mapping of token id -> bias, got {type(self.logit_bias).__name__}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise SamplingParamsError(
                f"logit_bias may have at most {MAX_LOGIT_BIAS_TOKENS} entries, got {len(self.logit_bias)}")
        for pair in self.logit_bias:  # every key an id first: the pairs are sorted only when all are
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise SamplingParamsError(f"logit_bias entries are (token id, bias) pairs, got {pair!r}")
            if not _is_int(pair[0]) or pair[0] < 0:
                raise SamplingParamsError(f"logit_bias keys must be token ids (integers >= 0), got {pair[0]!r}")
        previous = -1
        for token, bias in self.logit_bias:
            if token <= previous:
                raise SamplingParamsError(f"logit_bias has token id {token} more than once")
            previous = token
            if not _is_real(bias) or not (-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise SamplingParamsError(
                    f"logit_bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")

    def _validate_stop(self) -> None:
        if not isinstance(self.stop, tuple):
            raise SamplingParamsError(f"stop must be a string or a sequence of strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}"
            )
        for s in self.stop:
            if not isinstance(s, str):
                raise SamplingParamsError(f"every stop entry must be a string, got {s!r}")
            if not s:
                raise SamplingParamsError("stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise SamplingParamsError(
                    f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}"
                )
        if not isinstance(self.stop_token_ids, tuple):
            raise SamplingParamsError(
                f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}"
            )
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise SamplingParamsError(f"stop_token_ids must be non-negative integers, got {t!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax (temperature 0 or too small to divide by safely)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def max_stop_len(self) -> int:
        """Length in characters of the longest stop string (0 when there is none)."""
        return max((len(s) for s in self.stop), default=0)

    @classmethod
    def greedy(cls, max_tokens: int = 256, **kwargs: object) -> SamplingParams:
        """Greedy decoding (temperature 0); other fields as keyword arguments."""
        if "temperature" in kwargs:
            raise SamplingParamsError("SamplingParams.greedy() fixes temperature = 0; do not pass one")
        return cls(max_tokens=max_tokens, temperature=0.0, **kwargs)  # type: ignore[arg-type]

    def with_(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        unknown = set(changes) - {f.name for f in fields(self) if f.init}
        if unknown:
            raise SamplingParamsError(f"unknown sampling fields: {sorted(unknown)}")
        return replace(self, **changes)  # type: ignore[arg-type]


def _logit_bias_pairs(value: object) -> object:
    """A mapping (or iterable of pairs) of token id -> bias as (id, float bias) pairs sorted by id; anything else
    as it is, for `validate` to name. Ids are not converted (a string key is refused: over HTTP the protocol turns
    the JSON object's string keys into ids), and a repeated id stays repeated (refused)."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        return value

    def number(x: object) -> object:
        if isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)):
            return int(x)
        return x

    pairs = [(number(t), float(b) if isinstance(b, numbers.Real) and not isinstance(b, (bool, np.bool_)) else b)
             for t, b in items]
    if all(_is_int(t) for t, _ in pairs):
        pairs.sort(key=lambda pair: pair[0])
    return tuple(pairs)
