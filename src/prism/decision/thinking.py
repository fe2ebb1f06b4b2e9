"""Gated thinking: a question whose first readout is not confident enough (below the gate) gets to
reason, then is read again.

Owns that a question's reasoning draws its randomness from nothing but the question: its sampling seed is
derived from the decision's seed and the question's own text (not its position among siblings), and sampling
uses a per-request generator, so no sibling question or batch companion draws from its random stream.

What it samples from are the model's logits, and those are bitwise independent of a request's batch
companions and prefix-cache hits only in deterministic mode (`deterministic: true`). There a thinking
question's whole answer (whether its first readout passes the gate, its reasoning, its re-read) is the same
whatever its siblings, their order or a cache hit (`specs/spec_decision_thinking.py`). Outside it the logits
round differently with the batch and the hits: that can move a confidence across the gate or change a sampled
token, and with it the reasoning and the answer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..engine.inputs import PreparedPrompt
from ..engine.sampling import SamplingParams
from .questions import Question, finite_real, integral

THINKING_PREAMBLE = "Let me think about this step by step.\n"
# Ends with a newline, not a space: the answer token is read where the tokenizer puts it. After a trailing space (a
# token of its own in Qwen's BPE) a "Yes" or an "A" would be read where the text "answer: Yes" never has it (" Yes" is
# one token); after ":\n" a letter, a word or a digit starts a token, as the first readout's do after "assistant\n".
ANSWER_CUE = "\nFinal answer:\n"


@dataclass(frozen=True)
class ThinkingConfig:
    gate: float = 0.6  # think when the first readout's confidence is below this
    max_tokens: int = 128
    temperature: float = 0.7
    seed: int = 0

    def __post_init__(self) -> None:
        if not finite_real(self.gate) or not 0.0 <= self.gate <= 1.0:
            raise ValueError(f"the thinking gate must be a number in [0, 1], got {self.gate!r}")
        if not integral(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"thinking max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not finite_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"thinking temperature must be a finite number >= 0, got {self.temperature!r}")
        if not integral(self.seed):
            raise ValueError(f"thinking seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))  # (numpy's integers as Python's)
        object.__setattr__(self, "seed", int(self.seed))


def question_seed(config: ThinkingConfig, question: Question) -> int:
    data = f"{config.seed}\x00{question.kind}\x00{question.render()}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def thinking_request(prompt: PreparedPrompt, question: Question, config: ThinkingConfig, encode,
                     max_prompt_tokens: int | None = None) -> tuple[PreparedPrompt, SamplingParams] | None:
    """The reasoning generation: the question's prompt, the assistant starting to think. Its length is capped so
    that the re-read (`answer_after_thinking`) is a prompt the engine takes (`Engine.max_prompt_tokens`); None when
    not even one token fits (the question keeps its first readout)."""
    start = prompt.extended(encode(THINKING_PREAMBLE))
    max_tokens = config.max_tokens
    if max_prompt_tokens is not None:
        max_tokens = min(max_tokens, max_prompt_tokens - len(start.token_ids) - len(encode(ANSWER_CUE)))
        if max_tokens < 1:
            return None
    params = SamplingParams(max_tokens=max_tokens, temperature=config.temperature,
                            seed=question_seed(config, question), stop=(ANSWER_CUE.strip(),))
    return start, params


def reasoning_of(thought: list[int], decode, end_token_ids: tuple[int, ...]) -> list[int]:
    """The reasoning as the re-read shows it: a generation's tokens without the end-of-turn token it may end with
    (the answer would be read outside the assistant's turn) and without the tokens of the answer cue it stops on
    (the cue would appear twice): `answer_after_thinking` appends the cue once. `decode(ids)` keeps special tokens."""
    tokens = list(thought)
    while tokens and tokens[-1] in end_token_ids:
        tokens.pop()
    cue = ANSWER_CUE.strip()
    while tokens and cue in decode(tokens):
        tokens.pop()
    return tokens


def answer_after_thinking(prompt: PreparedPrompt, reasoning: list[int], encode) -> PreparedPrompt:
    """The second readout's prompt: the question, the reasoning (`reasoning_of` a generation), then the answer
    cue."""
    return prompt.extended(encode(THINKING_PREAMBLE) + list(reasoning) + encode(ANSWER_CUE))
