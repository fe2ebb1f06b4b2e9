"""Spec of the detokenizer's lossy UTF-8 decoder (`engine.detokenize.Utf8Decoder`), which every generated token's
bytes go through and which says where a prompt ends inside a character (`incomplete_tail`) and where a token's first
byte cuts one (`text_offset`).

- Fed any bytes in any pieces, it gives what decoding them whole gives (errors="replace": each maximal invalid run one
  U+FFFD, as `tokenizers`' `Tokenizer.decode` does).
- What it holds between pieces is the start of a character that the next bytes can still complete: Unicode's rule.
  Python's own decoder holds ED A0..BF (an encoded surrogate's start), which no bytes complete (the review of session
  33: a prompt of token ids ending in those two bytes had two U+FFFD the decode lacks put at its text's start).
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from prism.engine.detokenize import utf8_decoder


def _completes(held: bytes) -> bool:
    """Whether some continuation bytes make `held` one valid character (its third and fourth bytes, if any, may be
    any continuation byte; only the second is constrained)."""
    width = 2 if held[0] < 0xE0 else 3 if held[0] < 0xF0 else 4
    seconds = [held[1]] if len(held) > 1 else range(0x80, 0xC0)
    for second in seconds:
        candidate = held[:1] + bytes([second]) + held[2:]
        candidate += b"\x80" * (width - len(candidate))
        try:
            candidate.decode("utf-8")
        except UnicodeDecodeError:
            continue
        return True
    return False


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.binary(max_size=4) | st.sampled_from([b"\xed", b"\xa0", b"\xed\xa0", b"\xf0\x90", b"\xe2"]),
                       max_size=8))
@example(pieces=[b"\xed", b"\xa0", b"A"])
@example(pieces=[b"\xed\xbf"])
def spec_pieces_decode_as_the_whole_and_hold_only_completable_starts(pieces) -> None:
    decoder = utf8_decoder()
    text = ""
    for piece in pieces:
        text += decoder.decode(piece)
        held = decoder.held
        assert not held or _completes(held), f"after {pieces}: holds {held!r}, which no bytes complete"
    text += decoder.decode(b"", final=True)
    whole = b"".join(pieces).decode("utf-8", "replace")
    assert text == whole, f"{pieces}: decoded in pieces {text!r}, whole {whole!r}"


def spec_every_two_byte_start_is_held_only_if_completable() -> None:
    """Every one- and two-byte string, exhaustively."""
    for first in range(256):
        for rest in [b"", *(bytes([b]) for b in range(256))]:
            decoder = utf8_decoder()
            decoder.decode(bytes([first]) + rest)
            held = decoder.held
            assert not held or _completes(held), f"{bytes([first]) + rest!r}: holds {held!r}, which no bytes complete"
