"""KV capacity agreement across tensor-parallel ranks.

Owns invariant 10 (*TP capacity*): every rank allocates the MIN page count over all ranks, agreed
before any pool is allocated; a rank that has room for no page still joins the agreement, and then
every rank raises the same `KVCapacityError` (nobody allocates, nobody waits on a rank that left).
Rank 0's KV manager hands out page ids that address every rank's pool, so a rank with more pages than
another would let page ids point past the smaller pool (divergent KV, or a rank stuck in a collective).
"""

from __future__ import annotations

from typing import Protocol


class KVCapacityError(ValueError):
    """No KV page fits on at least one rank: the engine cannot start on any rank (a configuration
    problem, hence a ValueError like `ConfigError`)."""


class MinGroup(Protocol):
    world_size: int

    def min_int(self, value: int) -> int: ...


def agree_num_pages(group: MinGroup, local_pages: int) -> int:
    """The page count every rank allocates: min over ranks of `local_pages` (one collective).

    Raises KVCapacityError on every rank, with the same message, when the minimum is 0.
    """
    if isinstance(local_pages, bool) or not isinstance(local_pages, int) or local_pages < 0:
        raise ValueError(f"local_pages must be a non-negative int, got {local_pages!r}")
    agreed = group.min_int(local_pages)
    if agreed < 1:
        raise KVCapacityError(
            f"no KV page fits on at least one of the {group.world_size} tensor-parallel ranks (min pages = 0); "
            "every rank stops: raise kv_memory_bytes / num_gpu_pages or lower page_size"
        )
    return agreed
