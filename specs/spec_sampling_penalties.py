"""Spec of the logit adjustments (`prism.engine.penalties`, `prism.engine.sampler`): a row's penalties use only its
own history, and a row without them is sampled as if they did not exist.

On the sampler, for random batches of rows (greedy or seeded; each with none, some or all of logit_bias, the
repetition / frequency / presence penalties and min-p) with random histories and logits:
- a row's token and logprobs are those it gets sampled alone (batch independence, with its own history);
- its token is the one the definitions give: the argmax (greedy) or the seeded draw (sampled) over its logits
  adjusted here, token by token, from its own prompt and output (the repetition penalty over both; the frequency
  and presence penalties over the output only; the bias first);
- its reported logprob and alternatives are the raw logits' log-softmax, whatever the adjustments did;
- a row without any of these knobs gets bitwise what it gets when its companions have none either.

On the real engine (tiny checkpoint, CPU), with async scheduling: penalized requests (and companions without
knobs) give the tokens of the engine without async scheduling, which reads each step's tokens before launching
the next. A step launched before the host read the step in flight is sampled after that step's tokens were
appended: a history missing them (penalty inputs taken when the step is launched) changes the tokens.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import replace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.engine import sampler
from prism.engine.llm import LLM
from prism.engine.penalties import TokenHistory
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint

KNOBS = ("logit_bias", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p")


@st.composite
def rows(draw: st.DrawFn, vocab: int) -> tuple[list[SamplingParams], list[TokenHistory]]:
    """Params and histories for 1-6 rows; a third of the rows use none of the knobs."""
    tokens = st.lists(st.integers(0, vocab - 1), max_size=12)

    def one() -> tuple[SamplingParams, TokenHistory]:
        knobs = {} if draw(st.integers(0, 2)) == 0 else {
            k: v for k, v in (
                ("logit_bias", draw(st.dictionaries(st.integers(0, vocab - 1), st.sampled_from([-100.0, -3.0, 2.5]),
                                                    max_size=3))),
                ("repetition_penalty", draw(st.sampled_from([1.0, 0.7, 1.3, 2.0]))),
                ("frequency_penalty", draw(st.sampled_from([0.0, -0.5, 0.4, 2.0]))),
                ("presence_penalty", draw(st.sampled_from([0.0, -1.0, 1.5]))),
                ("min_p", draw(st.sampled_from([0.0, 0.1, 0.5]))),
            ) if draw(st.booleans())
        }
        logprobs = draw(st.one_of(st.none(), st.integers(0, 4)))
        if draw(st.booleans()):
            knobs.pop("min_p", None)
            params = SamplingParams(temperature=0.0, logprobs=logprobs, **knobs)
        else:
            params = SamplingParams(temperature=draw(st.sampled_from([0.6, 1.0, 1.8])), top_k=draw(st.sampled_from([0, 4])),
                                    seed=draw(st.integers(0, 1000)), logprobs=logprobs, **knobs)
        return params, TokenHistory(draw(tokens), draw(tokens))

    pairs = [one() for _ in range(draw(st.integers(1, 6)))]
    return [p for p, _ in pairs], [h for _, h in pairs]


def answers(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]) -> list[tuple]:
    """Each row's (token, logprob, alternatives or None), sampled together, each with a fresh generator."""
    result = sampler.sample(logits, params, [sampler.make_generator(p) for p in params], histories)
    out = []
    for i, p in enumerate(params):
        token = int(result.token_ids[i])
        if p.logprobs is None:
            out.append((token, None, None))
            continue
        (entry,) = sampler.token_logprobs(result, i, token, p.logprobs)
        out.append((token, entry.logprob, entry.top))
    return out


def reference_adjusted(logits: torch.Tensor, p: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """One row's logits adjusted from the definitions, token by token, in fp32 (the sampler's roundings)."""
    x = logits.clone()
    for token, bias in p.logit_bias:
        x[token] += bias
    r = torch.tensor(p.repetition_penalty, dtype=torch.float32)
    for token in set(history.prompt) | set(history.output):
        x[token] = x[token] * r if x[token] < 0 else x[token] / r
    f, pres = (torch.tensor(v, dtype=torch.float32) for v in (p.frequency_penalty, p.presence_penalty))
    for token, count in Counter(history.output).items():
        x[token] = x[token] - f * count
        x[token] = x[token] - pres
    return x


def without_knobs(p: SamplingParams) -> SamplingParams:
    return replace(p, logit_bias=(), repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), vocab=st.integers(2, 30), seed=st.integers(0, 2**31 - 1))
def spec_a_row_is_adjusted_from_its_own_history_only(data, vocab, seed) -> None:
    params, histories = data.draw(rows(vocab))
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    together = answers(logits, params, histories)
    stripped = answers(logits, [without_knobs(p) for p in params], histories)
    for i, (p, h) in enumerate(zip(params, histories, strict=True)):
        got, alone = together[i], answers(logits[i : i + 1], [p], [h])[0]
        assert _close(got, alone), f"row {i} ({p}) sampled {got} beside its companions, {alone} alone"
        if not p.adjusts_logits and p.min_p == 0.0:
            assert got == stripped[i], f"row {i} without knobs changed beside knobbed companions: {got}, {stripped[i]}"
        adjusted = reference_adjusted(logits[i], p, h)
        want = answers(adjusted[None], [replace(without_knobs(p), logprobs=None)], [h])[0][0]
        assert got[0] == want, f"row {i} ({p}, {h}) took {got[0]}; its adjusted logits {adjusted.tolist()} give {want}"
        if p.logprobs is not None:
            raw = torch.log_softmax(logits[i], dim=-1)
            assert abs(got[1] - float(raw[got[0]])) <= 1e-5, f"row {i}'s logprob is not the raw logits' log-softmax"
            top = torch.topk(raw, min(p.logprobs, vocab)).indices.tolist()
            assert [t for t, _ in got[2]] == top, f"row {i}'s alternatives are not the raw logits' most likely"


def _close(a: tuple, b: tuple) -> bool:
    """The same token and alternatives, logprobs within fp32 rounding (a batch's log-softmax may round otherwise)."""
    if a[0] != b[0] or (a[1] is None) != (b[1] is None):
        return False
    return a[1] is None or (abs(a[1] - b[1]) <= 1e-5 and [t for t, _ in a[2]] == [t for t, _ in b[2]])


# ---------------------------------------------------------------------------------------- on the engine

PROMPTS = ("Hi.", "Tell me a story about a cat.", "What is two plus two?", "Name three colours, please.")


@functools.cache
def engine(async_scheduling: bool) -> LLM:
    return LLM(ensure_tiny_checkpoint(), kv_dtype="fp8", page_size=16, num_gpu_pages=64, max_num_seqs=4,
               graph_rows_without_cuda=True, async_scheduling=async_scheduling, check_invariants=True)


@st.composite
def engine_requests(draw: st.DrawFn) -> list[tuple[str, SamplingParams]]:
    def one() -> tuple[str, SamplingParams]:
        knobs = draw(st.sampled_from([{}, {"presence_penalty": 2.0}, {"frequency_penalty": 1.0},
                                      {"repetition_penalty": 1.5}, {"presence_penalty": 1.5, "logit_bias": {364: -5.0}}]))
        greedy = draw(st.booleans())
        return draw(st.sampled_from(PROMPTS)), SamplingParams(
            max_tokens=draw(st.integers(4, 20)), temperature=0.0 if greedy else 0.9, seed=draw(st.integers(0, 99)),
            ignore_eos=True, **knobs)

    return [one() for _ in range(draw(st.integers(1, 4)))]


@settings(max_examples=8, deadline=None)
@given(requests=engine_requests())
def spec_async_scheduling_samples_on_the_whole_history(requests) -> None:
    prompts = [text for text, _ in requests]
    params = [p for _, p in requests]
    llm = engine(True)
    launched = llm.engine.stats.async_steps
    got = [c.token_ids for c in llm.generate(prompts, params)]
    want = [c.token_ids for c in engine(False).generate(prompts, params)]
    assert llm.engine.stats.async_steps > launched, "the spec needs steps launched on unread tokens"
    for (text, p), g, w in zip(requests, got, want, strict=True):
        assert g == w, f"async scheduling changed the tokens of {text!r} under {p}: {g}, without it {w}"
