"""Streamed text output: incremental detokenization, stop strings, and the per-request text stream.

Owns *the stream is the text*: for every request, the concatenation of all streamed deltas equals the
final text, which equals `tokenizer.decode(generated ids)` cut before the first stop string; no delta
ever splits a multi-byte UTF-8 character, and no delta contains a U+FFFD that the final text lacks.

How (byte-level BPE, e.g. Qwen): a token is a run of bytes that may end inside a UTF-8 character, so
decoding token by token is wrong. `IncrementalDetokenizer` decodes a short window of tokens
`[prefix_offset, len)` and emits what the window adds after `[prefix_offset, read_offset)`, and only
when the window's text does not end in U+FFFD (an incomplete character decodes to U+FFFD). A boundary
accepted that way is a *clean* boundary: the decoder holds no pending bytes there, and every lossy UTF-8
decoder resynchronises on the first non-continuation byte, so the window's text after a clean boundary
is exactly the whole sequence's text after it. The window starts a few prompt tokens back so decoders
that depend on the left context (leading-space rules) see some.

`StopChecker` finds stop strings that span tokens: it withholds the longest tail of the text that is
still a prefix of some stop string, so a stop string is never partly streamed before it is recognised.
`TextStream` combines both with stop token ids and EOS for the engine; token budgets (max_tokens,
max_model_len) stay with the engine, which ends a stream by `flush()`. A stop string completed only by that
flush (the budget cut a character, which flushes as U+FFFD, and the text held back with it) ends the text as one
completed mid-stream: cut before it, `finish_reason == "stop"`, which the engine reports instead of the budget
(`Engine._last_text`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from tokenizers import Tokenizer

from .sampling import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context in the first window (vLLM uses the same small number).
PROMPT_CONTEXT_TOKENS = 5


class DetokenizeError(ValueError):
    """A token id is not an integer >= 0, or a stream is used after it finished."""


def _check_id(token_id: object) -> int:
    if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
        raise DetokenizeError(f"token ids must be integers >= 0, got {token_id!r}")
    return token_id


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, never emitting an incomplete character.

    Ids beyond the tokenizer's vocabulary (the padded rows of a model's vocabulary) decode to "",
    exactly as `Tokenizer.decode` treats them.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if not hasattr(tokenizer, "decode"):
            raise DetokenizeError(f"tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        self._tok = tokenizer
        self._skip = bool(skip_special_tokens)
        # Only the context decoded here is checked: a prompt's ids came from the tokenizer, and walking all of
        # them cost ~0.4 ms per request of a 1,600-token prompt (every branch of a decision pays it).
        context = [_check_id(t) for t in list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(0, len(context))
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: no clean boundary to continue from, so the output is
            # decoded on its own (it then equals decode(generated ids), the stream's contract).
            self._ids, self._read_offset, self._prefix_text = [], 0, ""
        self._num_generated = 0
        self._finished = False
        self.text = ""  # everything emitted so far

    @property
    def num_generated(self) -> int:
        return self._num_generated

    def _decode(self, start: int, end: int) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text ("" while it is incomplete)."""
        if self._finished:
            raise DetokenizeError("add() after flush(): this detokenizer has finished")
        self._ids.append(_check_id(token_id))
        self._num_generated += 1
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text) :]
        # The window start moves to the old read offset (a clean boundary); the window stays short.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete tail then decodes to U+FFFD, as in the full text)."""
        if self._finished:
            return ""
        self._finished = True
        new_text = self._decode(self._prefix_offset, len(self._ids))
        delta = new_text[len(self._prefix_text) :]
        self.text += delta
        return delta


class StopChecker:
    """Finds the first stop string in a growing text and withholds text that may still start one."""

    def __init__(self, stop: Iterable[str]) -> None:
        self.stop = tuple(stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise DetokenizeError(f"stop strings must be non-empty strings, got {s!r}")
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text, once one did

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    @property
    def held(self) -> str:
        """Text received but not yet released (a possible beginning of a stop string)."""
        return self._held

    def feed(self, text: str) -> tuple[str, bool]:
        """Add newly decoded text; return (text safe to release, whether a stop string was found).

        After a stop, the released text ends right before the stop string and later calls release nothing.
        """
        if self.matched is not None:
            return "", True
        buf = self._held + text
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i, len(s)) < best[:2]):
                best = (i, len(s), s)
        if best is not None:
            self.matched = best[2]
            self._held = ""
            return buf[: best[0]], True
        hold = self._partial_len(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def _partial_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[len(buf) - k :]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def flush(self) -> str:
        """End of the text without a stop string: release everything held back."""
        if self.matched is not None:
            return ""
        out, self._held = self._held, ""
        return out


class TextStream:
    """The text side of one generated sequence: push token ids, get (delta_text, stopped).

    `push` reports stopped=True only for a reason found in the tokens or the text: a stop token id, an
    EOS id (when given, unless `params.ignore_eos`), or a stop string (the text is cut before it); then
    `finish_reason == "stop"` and `stop_reason` is the token id / stop string. The text of a stop or EOS
    token is never emitted. Any other end (max_tokens, max_model_len, an EOS the caller detects itself)
    is the caller's decision: it calls `flush()` for the last text, which may still complete a stop string (then
    the stream's stop is the reason, not the caller's). `text` is everything emitted so far.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] = (),
        eos_token_ids: Iterable[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise DetokenizeError(f"params must be SamplingParams, got {type(params).__name__}")
        self.params = params
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stops = StopChecker(params.stop)
        self._stop_ids = frozenset(params.stop_token_ids)
        eos = frozenset(_check_id(t) for t in eos_token_ids)
        self._eos_ids = frozenset() if params.ignore_eos else eos
        self.token_ids: list[int] = []
        self.text = ""
        self.finished = False
        self.finish_reason: Literal["stop"] | None = None
        self.stop_reason: str | int | None = None

    def push(self, token_id: int) -> tuple[str, bool]:
        """Consume one generated token; return the text to stream now and whether it stopped the sequence."""
        if self.finished:
            raise DetokenizeError("push() after the stream finished")
        token_id = _check_id(token_id)
        self.token_ids.append(token_id)
        if token_id in self._stop_ids or token_id in self._eos_ids:
            # The stop token's own text is dropped, but text held back before it is still released.
            out, hit = self._stops.feed(self._detok.flush())
            self._end(token_id if not hit else self._stops.matched)
            return self._emit(out + self._stops.flush()), True
        out, hit = self._stops.feed(self._detok.add(token_id))
        if hit:
            self._detok.flush()
            self._end(self._stops.matched)
            return self._emit(out), True
        return self._emit(out), False

    def flush(self) -> str:
        """The caller ends the sequence: release all held text (an incomplete tail decodes to U+FFFD).

        The held text may still complete a stop string: it is then cut there and `finish_reason` becomes
        "stop". After the stream has finished, returns "".
        """
        if self.finished:
            return ""
        self.finished = True
        out, hit = self._stops.feed(self._detok.flush())
        if hit:
            self.finish_reason, self.stop_reason = "stop", self._stops.matched
        return self._emit(out + self._stops.flush())

    def _end(self, why: str | int | None) -> None:
        self.finished = True
        self.finish_reason = "stop"
        self.stop_reason = why

    def _emit(self, out: str) -> str:
        self.text += out
        return out
