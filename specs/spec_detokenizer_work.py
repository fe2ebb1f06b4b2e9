"""Spec of the incremental detokenizer's cost (`prism.engine.detokenize`), on the generated Qwen-style byte-level
tokenizer of `prism.testing.tokenizer`.

Invariant: the work a detokenizer asks of its tokenizer (the ids it decodes, the tokens it looks up) over a whole
generation is linear in the generated tokens, whatever they are: in particular over a long run of tokens that never
ends a character (lone continuation bytes, lead bytes each cutting the one before, special tokens between them), where
decoding the pending run again at each token cost quadratic work. Its text stays `tokenizer.decode` of the tokens.
"""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from prism.engine.detokenize import IncrementalDetokenizer
from prism.testing.tokenizer import build_bpe_tokenizer

# Work allowed per generated token: one look-up of its bytes (at most; repeated ids are cached), with room to spare.
WORK_PER_TOKEN = 3


@functools.lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    return build_bpe_tokenizer(400)


class CountingTokenizer:
    """The tokenizer, counting the work asked of it: each id decoded and each token looked up is one unit."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.work = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.work += len(ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        self.work += 1
        return self._tok.id_to_token(token_id)

    def __getattr__(self, name: str):
        return getattr(self._tok, name)


@st.composite
def runs(draw: st.DrawFn) -> list[int]:
    """Generated tokens: a long run that never ends a character (of one kind of byte or mixed), special tokens maybe
    between its bytes, some text before and after it."""
    tok = tokenizer()
    byte = {b: tok.token_to_id(c) for b, c in {0x80: "Ģ", 0xBF: "¿", 0xE4: "ä", 0xF0: "ð"}.items()}
    specials = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    assert all(tok.decode([i]) == "\ufffd" for i in byte.values()), "premise: byte tokens that are no character alone"
    kinds = draw(st.sampled_from([[0x80], [0xBF], [0xE4], [0xF0], [0xE4, 0x80], [0xF0, 0x80, 0x80], [0x80, 0xE4]]))
    run = [byte[kinds[i % len(kinds)]] for i in range(draw(st.integers(150, 400)))]
    for _ in range(draw(st.integers(0, 20))):
        run.insert(draw(st.integers(0, len(run))), draw(st.sampled_from(specials)))
    before, after = (tok.encode(draw(st.sampled_from(["", "ok ", "你好", "a😀"]))).ids for _ in range(2))
    return before + run + after


@settings(max_examples=20, deadline=None)
@given(ids=runs(), skip=st.booleans())
def spec_the_detokenizers_work_is_linear_in_the_tokens(ids, skip) -> None:
    tok = CountingTokenizer(tokenizer())
    detok = IncrementalDetokenizer(tok, tok.encode("Hi").ids, skip_special_tokens=skip)  # type: ignore[arg-type]
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == tokenizer().decode(ids, skip_special_tokens=skip), "the text is not the decode of the tokens"
    assert tok.work <= WORK_PER_TOKEN * len(ids), (
        f"{len(ids)} tokens cost the tokenizer {tok.work} units of work (ids decoded, tokens looked up): "
        f"more than {WORK_PER_TOKEN} per token")
