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
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace

import numpy as np

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# A stop string is held back from the stream while it may still be completing: bound the hold-back.
MAX_STOP_STRING_CHARS = 256
MAX_N = 128
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts unsigned 64-bit seeds
GREEDY_TEMPERATURE_EPS = 1e-5


class SamplingParamsError(ValueError):
    """A sampling parameter has a bad type or value (the message names the field and the value)."""


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
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
                object.__setattr__(self, name, float(value))
        self.validate()

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
        return self

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
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise SamplingParamsError(f"unknown sampling fields: {sorted(unknown)}")
        return replace(self, **changes)  # type: ignore[arg-type]
