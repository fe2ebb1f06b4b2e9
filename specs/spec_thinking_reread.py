"""Spec of the gated-thinking re-read's reasoning (`prism.decision.thinking.reasoning_of`).

Invariant: the reasoning a re-read shows is the generation's own text, once: it never ends with an end-of-turn token
(the answer would be read outside the assistant's turn), never holds the answer cue the generation stopped on (the
cue is appended once after it), and a generation that ended on neither is shown whole. Over random reasoning texts
that end plainly, with the end-of-turn token, or on the cue (with or without text after it in its last token).
"""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from prism.decision import thinking
from prism.engine.llm import LLM
from prism.testing.checkpoints import ensure_tiny_checkpoint


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
