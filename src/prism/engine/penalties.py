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
int64 scatter indices of every history token and bias entry, and the float32 knob values and biases.
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
    chosen = [params[i] for i in rows]
    idx = None if len(rows) == batch else host_copy.to_device(rows, x.device, torch.int64)
    sub = x.clone() if idx is None else x.index_select(0, idx)
    plan = _Plan.of(chosen, [histories[i] for i in rows], vocab)
    ints = host_copy.to_device(plan.ints, x.device, torch.int64)
    floats = host_copy.to_device(plan.floats, x.device, torch.float32)
    n = len(rows)
    flat = sub.view(-1)
    if plan.num_bias:
        flat.index_add_(0, ints[plan.num_counted:], floats[3 * n:])
    if plan.planes:
        counts = torch.zeros(plan.planes * n * vocab, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, ints[: plan.num_counted], torch.ones(1, dtype=torch.int32, device=x.device)
                            .expand(plan.num_counted))
        counts = counts.view(plan.planes, n, vocab)
        output_counts = counts[0]
        knobs = floats[: 3 * n].view(3, n, 1)
        if plan.repetition:
            seen = (output_counts + counts[1]) > 0
            r = knobs[0]
            sub = torch.where(seen, torch.where(sub < 0, sub * r, sub / r), sub)
        if plan.frequency:
            sub = sub - knobs[1] * output_counts.float()
        if plan.presence:
            sub = sub - knobs[2] * (output_counts > 0).float()
    return sub if idx is None else x.index_copy(0, idx, sub)


@dataclass(frozen=True)
class _Plan:
    """The host side of one step's adjustments over its n adjusting rows (numbered 0..n-1 here).

    ints:   the flat positions in a [planes, n, V] count table of every output token (plane 0) and, when a row has a
            repetition penalty, of its prompt's distinct tokens (plane 1); then the flat positions in the [n, V]
            logits of every logit_bias entry.
    floats: the n repetition, n frequency and n presence penalties, then the logit_bias values.
    """

    ints: np.ndarray
    floats: np.ndarray
    num_counted: int
    num_bias: int
    planes: int
    repetition: bool
    frequency: bool
    presence: bool

    @classmethod
    def of(cls, params: list[SamplingParams], histories: list[TokenHistory | None], vocab: int) -> _Plan:
        n = len(params)
        repetition = any(p.repetition_penalty != 1.0 for p in params)
        planes = (2 if repetition else 1) if any(p.has_penalties for p in params) else 0
        counted: list[np.ndarray] = []
        for j, (p, history) in enumerate(zip(params, histories, strict=True)):
            if not p.has_penalties:
                continue
            if not isinstance(history, TokenHistory):
                raise SamplerError(f"row {j} has penalties but no TokenHistory")
            counted.append(_in_vocab(history.output, vocab, "output") + j * vocab)
            if p.repetition_penalty != 1.0:
                counted.append(_in_vocab(history.prompt, vocab, "prompt") + (n + j) * vocab)
        bias_at, bias = [], []
        for j, p in enumerate(params):
            for token, value in p.logit_bias:
                if token >= vocab:
                    raise SamplerError(f"logit_bias token id {token} is outside the vocabulary of {vocab}")
                bias_at.append(j * vocab + token)
                bias.append(value)
        counted_at = np.concatenate(counted) if counted else np.empty(0, dtype=np.int64)
        knobs = [[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                 [p.presence_penalty for p in params]]
        return cls(
            ints=np.concatenate([counted_at, np.asarray(bias_at, dtype=np.int64)]),
            floats=np.concatenate([np.asarray(knobs, dtype=np.float32).reshape(-1), np.asarray(bias, dtype=np.float32)]),
            num_counted=len(counted_at), num_bias=len(bias), planes=planes, repetition=repetition,
            frequency=any(p.frequency_penalty != 0.0 for p in params),
            presence=any(p.presence_penalty != 0.0 for p in params),
        )


def _in_vocab(tokens: Sequence[int] | np.ndarray, vocab: int, what: str) -> np.ndarray:
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise SamplerError(f"a {what} token id of a penalized row is outside the vocabulary of {vocab}")
    return ids
