"""Spec of liveness with chunked prefill off (`enable_chunked_prefill=False`; `Scheduler.chunk_end`), on the real
Scheduler and KVCacheManager through the liveness spec's harness.

Invariant: with chunked prefill off, every request whose prompt fits one step (the engine refuses the others)
finishes normally on a tight pool, preempted and recomputed (or swapped) as often as the pool needs: never failed by
the scheduler. A recomputed request's content is its prompt and the tokens it had generated; only the prompt must go
in one step. (Session 27's review: the whole content was required in one step, so a request preempted after
generating enough tokens was failed with "the prompt needs N tokens in one step".)
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specs.spec_scheduler_liveness import prompts, run


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def spec_no_request_fails_with_chunked_prefill_off(data) -> None:
    requests = data.draw(st.lists(st.tuples(prompts(), st.integers(4, 24)), min_size=2, max_size=6), "requests")
    arrivals = data.draw(st.lists(st.integers(0, 6), min_size=len(requests), max_size=len(requests)), "arrivals")
    pool = {"preemption": data.draw(st.sampled_from(["recompute", "swap"]), "preemption"),
            "pool_pages": data.draw(st.integers(8, 14), "pool pages"), "budget": data.draw(st.integers(14, 24), "budget")}
    stats = run(requests, arrivals, {}, **pool, chunked_prefill=False)
    assert stats["failed"] == 0, f"{stats['failed']} request(s) failed with chunked prefill off ({pool}, {stats})"
