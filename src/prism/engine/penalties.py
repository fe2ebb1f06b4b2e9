"""Logit adjustments before sampling: `logit_bias`, then the repetition, frequency and presence penalties.

Owns *a row's penalties use only its own history*: the counts a row is penalized by are those of its own
`TokenHistory` (its prompt's distinct tokens for the repetition penalty; its output so far for all three), held in
its own slot of the engine's count table (`penalty_counts`, which owns keeping a slot equal to its history), and each
row's knobs are its own `SamplingParams`' - so a row's adjusted logits depend only on its own logits, params and
history, never on its batch companions.

The order (vLLM's): the bias is added to the raw logits, then the repetition penalty (HF
`RepetitionPenaltyLogitsProcessor`: a seen token's logit divided by the penalty when positive, multiplied when not;
"seen" = in the prompt or the output), then the frequency and presence penalties (OpenAI: over the output only,
logit -= frequency * count + presence * (count > 0)). Temperature and the filters come after, in the sampler.

Cost: a step where no row adjusts its logits does nothing here (not one kernel or copy). Otherwise the rows that
do are taken out (one index copy), and every host value the step needs crosses in two non-blocking copies: the
int64 positions of the tokens the rows' slots have not counted yet (one per row in a decode step: a request's
history is counted once, not re-read every step) and of the bias entries, and the float32 knob values and biases.
The step's rows' counts are gathered from the table: an int32 [rows, vocab] tensor (and a bool one of the prompt's
tokens, for a repetition penalty), as large as the rows' fp32 logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..ops import host_copy
from .penalty_counts import CountsSlot, PenaltyCounts
from .sampling import SamplerError, SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """The tokens one row's penalties read: `prompt`, the prompt's token ids (only for the repetition penalty:
    distinct ids suffice, see `distinct_token_ids`), and `output`, every token generated so far in order (it only
    grows). `counts`: the request's slot in the count table, kept between its steps (`Request.token_history`); None
    counts the whole history for this step only (a row of the table taken for the step)."""

    prompt: Sequence[int] | np.ndarray
    output: Sequence[int] | np.ndarray
    counts: CountsSlot | None = None


def distinct_token_ids(token_ids: Sequence[int]) -> np.ndarray:
    """The distinct ids of `token_ids` (int64): what a prompt contributes to the repetition penalty, computed once
    per request instead of copying a long prompt every step."""
    return np.unique(np.asarray(token_ids, dtype=np.int64))


def adjusted_logits(
    x: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory | None],
    table: PenaltyCounts | None = None,
) -> torch.Tensor:
    """`x` [B, V] fp32 with each row's logit_bias and penalties applied: a new tensor, or `x` itself when no row
    adjusts its logits (x is never modified). The penalized rows' counts are kept in `table` (the engine's, kept
    between steps); without one, each is counted from its whole history in a table made for this step."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return x
    for i in rows:  # a penalty over a missing history would silently penalize nothing
        if params[i].has_penalties and not isinstance(histories[i], TokenHistory):
            raise SamplerError(f"row {i} has a repetition, frequency or presence penalty but no TokenHistory")
    batch, vocab = x.shape
    idx = None if len(rows) == batch else host_copy.to_device(rows, x.device, torch.int64)
    sub = x.clone() if idx is None else x.index_select(0, idx)
    plan = _Plan.of([params[i] for i in rows], [histories[i] for i in rows], vocab)
    if plan.penalized:
        histories = plan.histories
        if table is None:
            table, histories = _counted_this_step(x.device, vocab, histories)
        if (table.device, table.vocab) != (x.device, vocab):
            raise SamplerError(f"a count table of {table.vocab} tokens on {table.device} for logits of {vocab} on "
                               f"{x.device}")
        step = table.step(histories, plan.repetition_rows, plan.bias_at)
        bias_at = step.extra
    else:
        bias_at = host_copy.to_device(plan.bias_at, x.device, torch.int64)
    floats = host_copy.to_device(plan.floats, x.device, torch.float32)
    n = len(rows)
    if plan.num_bias:
        sub.view(-1).index_add_(0, bias_at, floats[3 * n :])
    if not plan.penalized:
        return sub if idx is None else x.index_copy(0, idx, sub)
    counts = step.counts  # row j's output count of each token
    knobs = floats[: 3 * n].view(3, n, 1)
    if plan.repetition:
        seen = (counts > 0) | step.prompt_seen
        r = knobs[0]
        sub = torch.where(seen, torch.where(sub < 0, sub * r, sub / r), sub)
    if plan.frequency:
        sub = sub - knobs[1] * counts.float()
    if plan.presence:
        sub = sub - knobs[2] * (counts > 0).float()
    return sub if idx is None else x.index_copy(0, idx, sub)


def _counted_this_step(device: torch.device, vocab: int, histories: list[TokenHistory | None]
                       ) -> tuple[PenaltyCounts, list[TokenHistory | None]]:
    """A table for this step's penalized rows and their histories without slot handles: each counted from scratch,
    none keeping a row of a table nobody keeps."""
    alone = [None if h is None else TokenHistory(h.prompt, h.output) for h in histories]
    return PenaltyCounts(device, vocab, slots=sum(h is not None for h in alone)), alone


@dataclass(frozen=True)
class _Plan:
    """The host side of one step's adjustments over its n adjusting rows (numbered 0..n-1 here).

    histories:       each row's history when it has a penalty (None otherwise): what its count slot is kept by.
    repetition_rows: whether each row has a repetition penalty (its slot's prompt plane is then filled).
    bias_at:         the flat position in [n, V] of every logit_bias entry.
    floats:          the n repetition, n frequency and n presence penalties, then the logit_bias values.
    """

    histories: list[TokenHistory | None]
    repetition_rows: list[bool]
    bias_at: np.ndarray
    floats: np.ndarray
    num_bias: int
    penalized: bool
    repetition: bool
    frequency: bool
    presence: bool

    @classmethod
    def of(cls, params: list[SamplingParams], histories: list[TokenHistory | None], vocab: int) -> _Plan:
        kept = [history if p.has_penalties else None for p, history in zip(params, histories, strict=True)]
        bias_at, bias = [], []
        for j, p in enumerate(params):
            for token, value in p.logit_bias:
                if token >= vocab:
                    raise SamplerError(f"logit_bias token id {token} is outside the vocabulary of {vocab}")
                bias_at.append(j * vocab + token)
                bias.append(value)
        knobs = [[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                 [p.presence_penalty for p in params]]
        repetition_rows = [p.repetition_penalty != 1.0 for p in params]
        return cls(
            histories=kept, repetition_rows=repetition_rows, bias_at=np.asarray(bias_at, dtype=np.int64),
            floats=np.concatenate([np.asarray(knobs, dtype=np.float32).reshape(-1), np.asarray(bias, dtype=np.float32)]),
            num_bias=len(bias),
            penalized=any(p.has_penalties for p in params),
            repetition=any(repetition_rows),
            frequency=any(p.frequency_penalty != 0.0 for p in params),
            presence=any(p.presence_penalty != 0.0 for p in params),
        )
