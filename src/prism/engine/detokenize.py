"""Streamed text output: incremental detokenization, stop strings, and the per-request text stream.

Owns *the stream is the text*: for every request, the concatenation of all streamed deltas equals the
final text, which is what its generated ids add to its prompt's text, cut before the first stop string: the decode
of prompt and generated ids together after the prompt's whole characters. That is `tokenizer.decode(generated ids)`
whenever the prompt ends on a character boundary (every chat prompt, every text prompt); a prompt of token ids that
ends inside a character has that character completed (or, cut, replaced by U+FFFD) at the start of the text, so that
the prompt's whole characters and the text are the decode of both together (the echo of a legacy completion). No
delta ever splits a multi-byte UTF-8 character, and no delta contains a U+FFFD that the final text lacks. The work
per generated token is bounded: one look-up of its bytes and one step of a UTF-8 decoder.

How: the tokenizers Prism loads are byte-level BPE (Qwen's; `ByteLevelVocab` refuses others): a token is a run of
bytes that may end inside a UTF-8 character, and `Tokenizer.decode` joins the bytes of the ids (special tokens
skipped or not, ids beyond the vocabulary none) and decodes them lossily, each maximal invalid run of bytes one
U+FFFD, exactly as Python's incremental UTF-8 decoder with errors="replace" does. `IncrementalDetokenizer` feeds each
generated token's bytes to one such decoder, which releases every character once it is complete and holds at most
the three bytes of an incomplete one. The decoder starts holding the prompt's incomplete last character, if any.

`StopChecker` finds stop strings that span tokens: it withholds the longest tail of the text that is
still a prefix of some stop string, so a stop string is never partly streamed before it is recognised.
`TextStream` combines both with stop token ids and EOS for the engine; token budgets (max_tokens,
max_model_len) stay with the engine, which ends a stream by `flush()`. A stop string completed only by that
flush (the budget cut a character, which flushes as U+FFFD, and the text held back with it) ends the text as one
completed mid-stream: cut before it, `finish_reason == "stop"`, which the engine reports instead of the budget
(`Engine._last_text`).
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from tokenizers import Tokenizer

from .sampling import SamplingParams

# The longest incomplete UTF-8 character: the first three bytes of a four-byte one.
MAX_INCOMPLETE_BYTES = 3


class DetokenizeError(ValueError):
    """A token id is not an integer >= 0, a tokenizer is not byte-level BPE, or a stream is used after it finished."""


def _check_id(token_id: object) -> int:
    if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
        raise DetokenizeError(f"token ids must be integers >= 0, got {token_id!r}")
    return token_id


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2 byte-level BPE alphabet: printable bytes map to themselves, the others to code points from 256 up.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class ByteLevelVocab:
    """A byte-level BPE tokenizer's tokens as bytes: `vocab(token_id)` is the exact bytes `Tokenizer.decode` puts in
    the text for it (vocabulary strings mapped back through the GPT-2 byte alphabet; an added token, `<|im_end|>`, its
    UTF-8; an id beyond the vocabulary nothing); `special` are the ids `decode(skip_special_tokens=True)` leaves out.
    Built once per tokenizer (`byte_level_vocab`), which is not changed after."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        _check_byte_level(tokenizer)
        self._tokenizer = weakref.ref(tokenizer)  # (held strongly, `_VOCABS`'s entry would keep its key alive)
        self.special = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self._bytes: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        if (hit := self._bytes.get(token_id)) is not None:
            return hit
        tokenizer = self._tokenizer()
        if tokenizer is None:
            raise DetokenizeError("the tokenizer of this vocabulary was dropped")
        piece = tokenizer.id_to_token(token_id)
        if piece is None:
            out = b""
        elif all(c in _UNICODE_TO_BYTE for c in piece):
            out = bytes(_UNICODE_TO_BYTE[c] for c in piece)
        else:  # the decoder's own rule: a token with a character outside the byte alphabet is its UTF-8
            out = piece.encode("utf-8")
        self._bytes[token_id] = out
        return out


def _check_byte_level(tokenizer: Any) -> None:
    if not hasattr(tokenizer, "decode"):
        raise DetokenizeError(f"tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    decoder = type(getattr(tokenizer, "decoder", None)).__name__
    if decoder != "ByteLevel":
        raise DetokenizeError(f"the tokenizer must be byte-level BPE (a ByteLevel decoder, as Qwen's), its decoder is "
                              f"{decoder}")


_VOCABS: weakref.WeakKeyDictionary[Any, ByteLevelVocab] = weakref.WeakKeyDictionary()


def byte_level_vocab(tokenizer: Tokenizer) -> ByteLevelVocab:
    """The tokenizer's `ByteLevelVocab`, built on first use (`DetokenizeError` unless it is byte-level BPE)."""
    _check_byte_level(tokenizer)
    vocab = _VOCABS.get(tokenizer)
    if vocab is None:
        vocab = _VOCABS[tokenizer] = ByteLevelVocab(tokenizer)
    return vocab


class Utf8Decoder:
    """The lossy UTF-8 decoder of `Tokenizer.decode`, fed bytes in pieces: Python's incremental one (errors="replace",
    which replaces each maximal invalid run as Rust's `from_utf8_lossy` does), but for one case. Python holds ED A0..BF
    (the start of an encoded surrogate) as if a character might still complete; Unicode's rule, and `tokenizers`, call
    it invalid at once, two U+FFFD. Held, it would be taken for a prompt's incomplete last character (`incomplete_tail`)
    and for a character a token's first byte may cut (`text_offset`)."""

    def __init__(self, held: bytes = b"") -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._decoder.setstate((held, 0))

    def decode(self, data: bytes, final: bool = False) -> str:
        text = self._decoder.decode(data, final)
        held = self._decoder.getstate()[0]
        if len(held) >= 2 and held[0] == 0xED and held[1] >= 0xA0:
            text += self._decoder.decode(b"", final=True)
            self._decoder.reset()
        return text

    @property
    def held(self) -> bytes:
        """The bytes of the incomplete character it holds (b"" on a character boundary)."""
        return self._decoder.getstate()[0]


def utf8_decoder(held: bytes = b"") -> Utf8Decoder:
    """A lossy UTF-8 decoder as `Tokenizer.decode` decodes, holding `held` (an incomplete character's first bytes)."""
    return Utf8Decoder(held)


def incomplete_tail(vocab: ByteLevelVocab, token_ids: Sequence[int]) -> bytes:
    """The bytes of the incomplete character the text of `token_ids` (special tokens kept) ends with, b"" if it ends
    on a character boundary. Only its last tokens are looked at: the character's bytes are among the last three."""
    end = b""
    for token_id in reversed(token_ids):
        end = vocab(_check_id(token_id)) + end
        if len(end) >= MAX_INCOMPLETE_BYTES:
            break
    decoder = utf8_decoder()
    decoder.decode(end[-MAX_INCOMPLETE_BYTES:])
    return decoder.held


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, never emitting an incomplete character (see the module docstring:
    the text continues the prompt's incomplete last character, if any).

    Ids beyond the tokenizer's vocabulary (the padded rows of a model's vocabulary) decode to "",
    exactly as `Tokenizer.decode` treats them.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._vocab = byte_level_vocab(tokenizer)
        self._skipped = self._vocab.special if skip_special_tokens else frozenset()
        self._utf8 = utf8_decoder(incomplete_tail(self._vocab, prompt_token_ids))
        self._num_generated = 0
        self._finished = False
        self.text = ""  # everything emitted so far

    @property
    def num_generated(self) -> int:
        return self._num_generated

    def add(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text ("" while it is incomplete)."""
        if self._finished:
            raise DetokenizeError("add() after flush(): this detokenizer has finished")
        token_id = _check_id(token_id)
        self._num_generated += 1
        if token_id in self._skipped:
            return ""
        delta = self._utf8.decode(self._vocab(token_id))
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete tail then decodes to U+FFFD, as in the full text)."""
        if self._finished:
            return ""
        self._finished = True
        delta = self._utf8.decode(b"", final=True)
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
