"""Spec: requests about the same material compute it once (`defer_shared_prefill_tokens`), on the real Scheduler and
KVCacheManager (the liveness spec's step loop).

A few materials (images and text) and requests of a material plus a question of its own (its first token unique, so
two requests share exactly their material), arriving together or a few steps apart, on a pool large enough that
nothing is evicted or preempted. Whatever the arrivals, the token budget and the chunking, the prompt tokens computed
in all are at most each material used once, plus every question, plus a page per request (a hit's tail rows below
the copy threshold, the last prompt token a hit leaves to compute, a deterministic hit's page boundary). The
historical behaviour admitted every such request in the same step and computed the material once per request (W7's
32 decides over 4 materials computed 32 of them, H200 session 23). Every request still terminates, with or without
deterministic (page-aligned) hits.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prism.kv.content import MediaSpan
from specs.spec_scheduler_liveness import FakePrompt, run

PAGE = 4  # the step loop's page size


@st.composite
def materials(draw, index: int) -> list[int | tuple[int, int]]:
    """Blocks of a material: text tokens, or (image length, digest byte). It starts with a token of its own, so two
    materials share nothing."""
    blocks: list = [[50 + index]]
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            blocks.append((draw(st.integers(2, 10)), draw(st.integers(1, 3))))
        else:
            blocks.append(draw(st.lists(st.integers(1, 4), min_size=1, max_size=6)))
    return blocks


def prompt_of(material: list, question: list[int]) -> FakePrompt:
    tokens: list[int] = []
    spans = []
    for block in material:
        if isinstance(block, tuple):
            spans.append(MediaSpan(len(tokens), block[0], bytes([block[1]]) * 16))
            tokens += [9] * block[0]
        else:
            tokens += block
    return FakePrompt(tokens + question, tuple(spans))


@settings(max_examples=80, deadline=None)
@given(data=st.data(), budget=st.integers(8, 64), deterministic=st.booleans())
def spec_a_material_asked_about_together_is_computed_once(data, budget: int, deterministic: bool) -> None:
    mats = [data.draw(materials(k)) for k in range(data.draw(st.integers(1, 2)))]
    n = data.draw(st.integers(2, 6))
    chosen = [data.draw(st.integers(0, len(mats) - 1)) for _ in range(n)]
    questions = [[100 + i] + data.draw(st.lists(st.integers(1, 4), max_size=3)) for i in range(n)]
    requests = [(prompt_of(mats[m], q), data.draw(st.integers(1, 4))) for m, q in zip(chosen, questions, strict=True)]
    arrivals = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    stats = run(requests, arrivals, {}, "recompute", pool_pages=256, budget=budget, page_aligned_hits=deterministic,
                defer=1, max_num_seqs=8)
    assert stats["preemptions"] == 0, "the pool was meant to be large enough for everyone"
    material_tokens = sum(len(prompt_of(mats[m], []).token_ids) for m in set(chosen))
    bound = material_tokens + sum(len(q) for q in questions) + n * PAGE
    assert stats["prompt_tokens_computed"] <= bound, (
        f"{stats['prompt_tokens_computed']} prompt tokens computed, but the materials once, the questions and a page "
        f"per request are {bound}: a material was computed again beside its running prefill")
