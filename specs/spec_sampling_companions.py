"""Spec of the sampler's batch independence (`prism.engine.sampler`): what a request gets from a step does not
depend on the requests sampled beside it.

Invariant: for every row of a batch, its token (greedy, or drawn from its own seeded generator, with or without
top-k / top-p), the logprob of that token, and its `params.logprobs` most likely alternatives (exactly that many:
0 means none, as vLLM and OpenAI count them) are those the same row gets sampled alone. The batch computes as many
alternatives as its most demanding row asked for; a row given its companions' count is the bug this spec
catches (found in session 27: `logprobs=2` beside a `logprobs=7` request answered 7 alternatives).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.engine import sampler
from prism.engine.sampling import SamplingParams


@st.composite
def rows(draw: st.DrawFn) -> list[SamplingParams]:
    def one() -> SamplingParams:
        logprobs = draw(st.one_of(st.none(), st.integers(0, 6)))
        if draw(st.booleans()):
            return SamplingParams(temperature=0.0, logprobs=logprobs)
        return SamplingParams(temperature=draw(st.sampled_from([0.5, 1.0, 2.0])), top_k=draw(st.sampled_from([0, 3])),
                              top_p=draw(st.sampled_from([1.0, 0.8])), seed=draw(st.integers(0, 1000)),
                              logprobs=logprobs)

    return [one() for _ in range(draw(st.integers(1, 6)))]


def answers(logits: torch.Tensor, params: list[SamplingParams]) -> list[tuple[int, list | None]]:
    """Each row's (token, logprobs entry or None), sampled together, each with a fresh generator of its seed."""
    result = sampler.sample(logits, params, [sampler.make_generator(p) for p in params])
    out = []
    for i, p in enumerate(params):
        token = int(result.token_ids[i])
        entry = sampler.token_logprobs(result, i, token, p.logprobs) if p.logprobs is not None else None
        out.append((token, entry))
    return out


@settings(max_examples=150, deadline=None)
@given(params=rows(), vocab=st.integers(2, 40), seed=st.integers(0, 2**31 - 1))
def spec_a_row_samples_as_it_would_alone(params, vocab, seed) -> None:
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    together = answers(logits, params)
    for i, p in enumerate(params):
        ((token, entry),) = answers(logits[i : i + 1], [p])
        got_token, got_entry = together[i]
        assert got_token == token, f"row {i} drew {got_token} beside its companions, {token} alone"
        if p.logprobs is None:
            assert got_entry is None, f"row {i} asked for no logprobs and got some"
            continue
        (got,), (want,) = got_entry, entry
        assert len(got.top) == min(p.logprobs, vocab), \
            f"row {i} asked for {p.logprobs} alternatives and got {len(got.top)} beside its companions"
        assert [t for t, _ in got.top] == [t for t, _ in want.top], f"row {i}'s alternatives follow its companions"
        assert abs(got.logprob - want.logprob) <= 1e-5, f"row {i}'s logprob follows its companions"
