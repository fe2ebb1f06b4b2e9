"""Engines shared by a property's examples, each handed on only while it holds nothing of the requests it served.

Owns the one definition of an engine (or `LLM`) that holds nothing: `holdings` counts what it still holds for
requests, every count 0 once they are all gone and their events delivered; the prefix cache is no holding (its pages
serve any later request, as on any engine that served before; a spec that wants a cold cache clears it).

A spec builds an engine once (seconds on the tiny checkpoint) and shares it between its examples (`reused_while_clean`,
a `functools.cache` that checks). After a failed or interrupted example (its failure already reported) the engine may
still hold that example's requests, pages, unread events or open streams; the next example would step them beside its
own, have its request ids refused as in use, run on a smaller pool, count their events as its own, or fail the same
leak check again: it would fail (or pass) for what another example did, and Hypothesis, shrinking or replaying, reports
"Inconsistent data generation", a flaky test, or a minimal example that fails only after another. Such an engine is
built anew. While examples pass the engine holds nothing after each, and the same one serves them all.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TypeVar

from ..engine.engine import Engine
from ..engine.llm import LLM

Owner = TypeVar("Owner", Engine, LLM)


def holdings(owner: Engine | LLM) -> dict[str, int]:
    """What `owner` holds for requests, by kind: all 0 when it holds nothing but its prefix cache."""
    engine = owner.engine if isinstance(owner, LLM) else owner
    kv = engine.kv
    held = {
        "engine requests": len(engine.requests),
        "questions not forked": len(engine._unspawned),
        "engine requests unfinished": engine.scheduler.num_unfinished,
        "engine events unread": len(engine._events),
        "detokenizers": len(engine._streams),
        "steps in flight": int(engine._inflight is not None),
        "penalty count slots": engine.penalty_counts.in_use,
        "KV sequences": len(kv.seqs),
        "KV pages held not only by the prefix cache": kv.gpu.num_used - kv.entries.num_reclaimable(),
        "KV swap pages": kv.cpu.num_used,
        "KV moves planned": int(not kv.plan.is_empty()),
    }
    if isinstance(owner, LLM):
        held["LLM calls' mailboxes"] = len(owner._mailboxes)
        held["LLM streams dropped, not aborted yet"] = len(owner._abandoned)
    return held


def reused_while_clean(build: Callable[..., Owner]) -> Callable[..., Owner]:
    """`build`'s engine for its arguments (defaults filled in: `f(True)` and `f(True, False)` share one), built once
    and returned again as long as it holds nothing (`holdings`); one that holds anything is built anew. Call it when
    an example starts, not while the engine serves it (it would be dropped for what it holds then). `cache_clear()`
    drops them all (the planted checks: an engine built with a planted bug is not kept)."""
    signature = inspect.signature(build)
    built: dict[tuple, Owner] = {}

    @functools.wraps(build)
    def shared(*args, **kwargs) -> Owner:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = tuple(bound.arguments.items())
        owner = built.get(key)
        if owner is None or any(holdings(owner).values()):
            owner = built[key] = build(*args, **kwargs)
        return owner

    shared.cache_clear = built.clear
    return shared
