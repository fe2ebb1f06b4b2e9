"""Token sampling over a batch of logits: logit adjustments, greedy, temperature, top-k, top-p, min-p, per-request
seeds, logprobs.

Owns *seeded sampling is batch-independent*: a row's token depends only on its own logits, its own
`SamplingParams`, its own generator and its own token history, never on its batch companions. Four choices
guarantee it:
- every tensor op is row-wise (sort, softmax, cumsum, searchsorted along the vocabulary axis), and which
  path a row takes (greedy / plain / filtered) depends only on its own parameters;
- a row's logit_bias and penalties are built from its own history only (`penalties`, which owns that rule);
- a sampled row draws exactly one uniform per step, from its own generator when it has one (inverse-CDF
  sampling), so a companion cannot advance or shift another row's random stream;
- the draw for a seeded row comes from its generator on the generator's device (a CPU
  `torch.Generator().manual_seed(seed)` gives the same stream whatever device the logits are on).

The order of the transformations (vLLM's for the first two, HF transformers' `_get_logits_processor` warper order,
5.17, for the rest):
1. `logit_bias`, then the repetition, frequency and presence penalties, on the raw fp32 logits (`penalties`);
2. greedy rows take the argmax of those adjusted logits (ties -> lowest token id);
3. sampled rows: temperature, then top-k, then top-p over the renormalised top-k mass, then min-p (a token is
   dropped when its probability is below min_p times the most likely token's), then one inverse-CDF draw.
A row using none of these knobs costs nothing more than before they existed: no kernel, no copy.

All probability arithmetic is fp32. Reported logprobs are the log-softmax of the *unmodified* fp32 logits (vLLM's
default "raw" logprobs), whatever the bias, penalties, temperature and filters did to the sampling distribution.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..ops import host_copy
from .penalties import TokenHistory, adjusted_logits
from .penalty_counts import PenaltyCounts
from .request import TokenLogprobs
from .sampling import SamplerError, SamplingParams


@dataclass(frozen=True)
class SampleResult:
    """One step's choices for a batch of B rows.

    token_ids:     [B] int64, the chosen tokens.
    logprobs:      [B] fp32, log-softmax of each chosen token under the unmodified fp32 logits; None when no
                   row asked for logprobs (the vocabulary-wide log-softmax is then not computed: most decode
                   steps, where it was two kernels and ~35 us of an 8B step on the H200).
    top_token_ids: [B, k] int64 or None; k = max `logprobs` requested in the batch (None when no row
                   asked for logprobs). Sorted by decreasing logprob; a row that asked for fewer
                   alternatives uses only its first `params.logprobs` columns.
    top_logprobs:  [B, k] fp32 or None, the logprobs of `top_token_ids`.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_token_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None


def generator_seed(seed: int) -> int:
    """The seed a request's generator is given for its `seed` (0 .. 2**64 - 1). A CPU generator (mt19937) keeps only
    a seed's low 32 bits, so seeds that differ above them sampled alike (1 and 2**32 + 1; -1 and 2**32 - 1 over
    HTTP). Seeds below 2**32 are kept; larger ones are hashed to 32 bits (two seeds still coincide with chance
    2**-32, which 32 bits of generator state cannot avoid)."""
    if seed < 2**32:
        return seed
    return int.from_bytes(hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=4).digest(), "little")


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The generator of a request: seeded from `params.seed` (`generator_seed`), or None (the global RNG) without
    one."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(generator_seed(params.seed))


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
    counts: PenaltyCounts | None = None,
) -> SampleResult:
    """Pick one token per row of `logits` [B, V] under `params[i]`, drawing from `generators[i]`; a row with a
    penalty reads its tokens so far in `histories[i]` (None for rows without), counted in `counts` (the engine's
    table, kept between steps; None: counted for this step only)."""
    gens, hists = _check_inputs(logits, params, generators, histories)
    raw = logits.float()  # a no-op view for fp32 input: never modified in place below
    x = adjusted_logits(raw, params, hists, counts)  # raw itself unless a row has a logit_bias or a penalty
    batch, vocab = x.shape
    device = x.device

    token_ids = torch.argmax(x, dim=-1)  # greedy for every row; sampled rows are overwritten
    plain = [i for i, p in enumerate(params) if not p.is_greedy and not _needs_filter(p, vocab)]
    filtered = [i for i, p in enumerate(params) if not p.is_greedy and _needs_filter(p, vocab)]
    for rows, draw in ((plain, _sample_plain), (filtered, _sample_filtered)):
        if not rows:
            continue
        idx = host_copy.to_device(rows, device, torch.int64)
        chosen = draw(x.index_select(0, idx), [params[i] for i in rows], _uniforms(rows, gens, device))
        token_ids = token_ids.index_copy(0, idx, chosen)

    wanted = [p.logprobs for p in params if p.logprobs is not None]
    if not wanted:
        return SampleResult(token_ids=token_ids, logprobs=None, top_token_ids=None, top_logprobs=None)
    logp = torch.log_softmax(raw, dim=-1)
    chosen_logprobs = logp.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_lp, top_ids = torch.topk(logp, min(max(wanted), vocab), dim=-1, largest=True, sorted=True)
    return SampleResult(
        token_ids=token_ids, logprobs=chosen_logprobs, top_token_ids=top_ids, top_logprobs=top_lp
    )


def _check_inputs(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None,
    histories: Sequence[TokenHistory | None] | None,
) -> tuple[list[torch.Generator | None], list[TokenHistory | None]]:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise SamplerError(
            f"logits must be a 2-D tensor [B, V], got {getattr(logits, 'shape', type(logits))}"
        )
    if not logits.is_floating_point():
        raise SamplerError(f"logits must be floating point, got {logits.dtype}")
    batch, vocab = logits.shape
    if vocab < 1:
        raise SamplerError("logits have an empty vocabulary axis")
    if len(params) != batch:
        raise SamplerError(f"got {len(params)} SamplingParams for {batch} logit rows")
    gens = [None] * batch if generators is None else list(generators)
    if len(gens) != batch:
        raise SamplerError(f"got {len(gens)} generators for {batch} logit rows")
    hists = [None] * batch if histories is None else list(histories)
    if len(hists) != batch:
        raise SamplerError(f"got {len(hists)} token histories for {batch} logit rows")
    for i, (p, g) in enumerate(zip(params, gens, strict=True)):
        if not isinstance(p, SamplingParams):
            raise SamplerError(f"params[{i}] is not a SamplingParams: {type(p).__name__}")
        if g is not None and not isinstance(g, torch.Generator):
            raise SamplerError(f"generators[{i}] is not a torch.Generator: {type(g).__name__}")
        # A silently unseeded draw would break the reproducibility the request asked for.
        if p.seed is not None and not p.is_greedy and g is None:
            raise SamplerError(f"row {i} has seed={p.seed} but no generator (use make_generator)")
    return gens, hists


def _needs_filter(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`t[rows]` (rows of a device tensor picked by a host list) without a blocking host-to-device copy."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, host_copy.to_device(rows, t.device, torch.int64))


def _uniforms(rows: list[int], gens: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row: from the row's own generator, else from the global RNG (one batched draw)."""
    free = [j for j, r in enumerate(rows) if gens[r] is None]
    if len(free) == len(rows):
        return torch.rand(len(rows), dtype=torch.float32, device=device)
    out = torch.empty(len(rows), dtype=torch.float32, device=device)
    if free:
        out.index_copy_(0, host_copy.to_device(free, device, torch.int64),
                        torch.rand(len(free), dtype=torch.float32, device=device))
    # Group seeded draws by generator device so a CPU generator costs one host->device copy per step.
    by_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    for j, r in enumerate(rows):
        g = gens[r]
        if g is not None:
            pos, vals = by_device.setdefault(g.device, ([], []))
            pos.append(j)
            vals.append(torch.rand(1, generator=g, dtype=torch.float32, device=g.device))
    for pos, vals in by_device.values():
        drawn = torch.cat(vals)
        drawn = host_copy.to_device(drawn, device, torch.float32) if drawn.device.type == "cpu" else drawn.to(device)
        out.index_copy_(0, host_copy.to_device(pos, device, torch.int64), drawn)
    return out


def _column(values: list[float] | list[int], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return host_copy.to_device(values, like.device, dtype).unsqueeze(1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i with cdf[i-1] <= u * total < cdf[i]: a zero-probability entry is never chosen."""
    cdf = torch.cumsum(probs, dim=-1)
    target = u.unsqueeze(1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)


def _sample_plain(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Temperature only: sample from softmax(x / T) over the vocabulary in id order."""
    temps = _column([p.temperature for p in params], x, torch.float32)
    probs = torch.softmax(x / temps, dim=-1)
    return _inverse_cdf(probs, u)


def _sample_filtered(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p (`filtered_distribution`), then sample."""
    probs, order = filtered_distribution(x, params)
    pos = _inverse_cdf(probs, u)
    return order.gather(1, pos.unsqueeze(1)).squeeze(1)


def filtered_distribution(x: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, order): each row's probabilities in decreasing order of its tempered logits (unnormalised, 0 for a
    dropped token), and the token id of each position. Temperature, then top-k, then top-p over the renormalised
    top-k mass, then min-p (HF's warper order)."""
    rows, vocab = x.shape
    temps = _column([p.temperature for p in params], x, torch.float32)
    # Stable descending sort: among equal logits the lower id ranks first, so cut-offs are deterministic.
    sorted_logits, order = torch.sort(x / temps, dim=-1, descending=True, stable=True)
    ks = _column([p.top_k if 0 < p.top_k < vocab else vocab for p in params], x, torch.int64)
    rank = torch.arange(vocab, device=x.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(rank >= ks, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    top_ps = _column([p.top_p for p in params], x, torch.float32)
    # Keep token r iff the mass strictly before it is < p: the smallest prefix with mass >= p.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = (mass_before >= top_ps) & (top_ps < 1.0)
    drop[:, 0] = False  # the most likely token always survives (rounding cannot empty the set)
    probs = probs.masked_fill(drop, 0.0)
    if any(p.min_p > 0.0 for p in params):
        # probs[:, 0] is the most likely token's, kept above: the threshold compares within one normalisation.
        min_ps = _column([p.min_p for p in params], x, torch.float32)
        probs = probs.masked_fill(probs < min_ps * probs[:, :1], 0.0)
    return probs, order


def token_logprobs(result: SampleResult, row: int, token: int, alternatives: int) -> list[TokenLogprobs]:
    """The logprob of row `row`'s sampled `token`, with the row's own `alternatives` (its `params.logprobs`) most
    likely tokens: the batch's columns are as many as its most demanding row asked for, so a row's answer must not
    depend on its companions."""
    top: list[tuple[int, float]] = []
    if result.top_token_ids is not None and alternatives > 0:
        top = list(zip(result.top_token_ids[row, :alternatives].tolist(),
                       result.top_logprobs[row, :alternatives].tolist(), strict=True))
    return [TokenLogprobs(token, float(result.logprobs[row]), top)]
