"""Logit adjustments before sampling: `logit_bias`, then the repetition, frequency and presence penalties.

Owns *a row's penalties use only its own history*: the counts a row is penalized by are built from that row's own
`TokenHistory` (its prompt's distinct tokens for the repetition penalty; its output so far for all three), scattered
into that row's line of a [rows, vocab] table, and each row's knobs are its own `SamplingParams`' - so a row's
adjusted logits depend only on its own logits, params and history, never on its batch companions.

The order (vLLM's): the bias is added to the raw logits, then the repetition penalty (HF
`RepetitionPenaltyLogitsProcessor`: a seen token's logit divided by the penalty when positive, multiplied when not;
"seen" = in the prompt or the output), then the frequency and presence penalties (OpenAI: over the output only,
logit -= frequency * count + presence * (count > 0)). Temperature and the filters come after, in the sampler.

Cost: a step where no row adjusts its logits does nothing here (not one kernel or copy). Otherwise the rows that
do are taken out (one index copy), and every host value the step needs crosses in two non-blocking copies: the
int64 positions of every history token and bias entry, and the float32 knob values and biases. The device holds an
int32 [rows, vocab] table of output counts (and a bool one of the tokens seen, for a repetition penalty): as large
as the rows' fp32 logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..ops import host_copy
from .sampling import SamplerError, SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """The tokens one row's penalties read: `prompt`, the prompt's token ids (only for the repetition penalty:
    distinct ids suffice, see `distinct_token_ids`), and `output`, every token generated so far in order."""

    prompt: Sequence[int] | np.ndarray
    output: Sequence[int] | np.ndarray


def distinct_token_ids(token_ids: Sequence[int]) -> np.ndarray:
    """The distinct ids of `token_ids` (int64): what a prompt contributes to the repetition penalty, computed once
    per request instead of copying a long prompt every step."""
    return np.unique(np.asarray(token_ids, dtype=np.int64))


def adjusted_logits(
    x: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory | None]
) -> torch.Tensor:
    """`x` [B, V] fp32 with each row's logit_bias and penalties applied: a new tensor, or `x` itself when no row
    adjusts its logits (x is never modified)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return x
    batch, vocab = x.shape
    idx = None if len(rows) == batch else host_copy.to_device(rows, x.device, torch.int64)
    sub = x.clone() if idx is None else x.index_select(0, idx)
    plan = _Plan.of([params[i] for i in rows], [histories[i] for i in rows], vocab)
    ints = host_copy.to_device(plan.ints, x.device, torch.int64)
    floats = host_copy.to_device(plan.floats, x.device, torch.float32)
    n = len(rows)
    output_at, prompt_at, bias_at = ints.split([plan.num_output, plan.num_prompt, plan.num_bias])
    if plan.num_bias:
        sub.view(-1).index_add_(0, bias_at, floats[3 * n :])
    if not plan.penalized:
        return sub if idx is None else x.index_copy(0, idx, sub)
    counts = torch.zeros(n * vocab, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, output_at, torch.ones(1, dtype=torch.int32, device=x.device).expand(plan.num_output))
    counts = counts.view(n, vocab)  # row j's output count of each token
    knobs = floats[: 3 * n].view(3, n, 1)
    if plan.repetition:
        seen = counts > 0
        seen.view(-1).index_fill_(0, prompt_at, True)
        r = knobs[0]
        sub = torch.where(seen, torch.where(sub < 0, sub * r, sub / r), sub)
    if plan.frequency:
        sub = sub - knobs[1] * counts.float()
    if plan.presence:
        sub = sub - knobs[2] * (counts > 0).float()
    return sub if idx is None else x.index_copy(0, idx, sub)


@dataclass(frozen=True)
class _Plan:
    """The host side of one step's adjustments over its n adjusting rows (numbered 0..n-1 here), positions flat in
    [n, V].

    ints:   the position of every output token of a penalized row, then of every distinct prompt token of a row with
            a repetition penalty, then of every logit_bias entry.
    floats: the n repetition, n frequency and n presence penalties, then the logit_bias values.
    """

    ints: np.ndarray
    floats: np.ndarray
    num_output: int
    num_prompt: int
    num_bias: int
    penalized: bool
    repetition: bool
    frequency: bool
    presence: bool

    @classmethod
    def of(cls, params: list[SamplingParams], histories: list[TokenHistory | None], vocab: int) -> _Plan:
        outputs: list[np.ndarray] = []
        prompts: list[np.ndarray] = []
        for j, (p, history) in enumerate(zip(params, histories, strict=True)):
            if not p.has_penalties:
                continue
            if not isinstance(history, TokenHistory):
                raise SamplerError(f"row {j} has penalties but no TokenHistory")
            outputs.append(_in_vocab(history.output, vocab, "output") + j * vocab)
            if p.repetition_penalty != 1.0:
                prompts.append(_in_vocab(history.prompt, vocab, "prompt") + j * vocab)
        bias_at, bias = [], []
        for j, p in enumerate(params):
            for token, value in p.logit_bias:
                if token >= vocab:
                    raise SamplerError(f"logit_bias token id {token} is outside the vocabulary of {vocab}")
                bias_at.append(j * vocab + token)
                bias.append(value)
        output_at, prompt_at = (np.concatenate(a) if a else np.empty(0, dtype=np.int64) for a in (outputs, prompts))
        knobs = [[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                 [p.presence_penalty for p in params]]
        return cls(
            ints=np.concatenate([output_at, prompt_at, np.asarray(bias_at, dtype=np.int64)]),
            floats=np.concatenate([np.asarray(knobs, dtype=np.float32).reshape(-1), np.asarray(bias, dtype=np.float32)]),
            num_output=len(output_at), num_prompt=len(prompt_at), num_bias=len(bias),
            penalized=any(p.has_penalties for p in params),
            repetition=any(p.repetition_penalty != 1.0 for p in params),
            frequency=any(p.frequency_penalty != 0.0 for p in params),
            presence=any(p.presence_penalty != 0.0 for p in params),
        )


def _in_vocab(tokens: Sequence[int] | np.ndarray, vocab: int, what: str) -> np.ndarray:
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise SamplerError(f"a {what} token id of a penalized row is outside the vocabulary of {vocab}")
    return ids
