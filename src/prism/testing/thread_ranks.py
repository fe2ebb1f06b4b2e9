"""Simulated TP ranks as threads of one process: a stand-in for `TPGroup` in property-based specs.

`ThreadWorld(n).ranks()` gives n `ThreadRank`s whose collectives (`min_int`, `all_gather`,
`all_reduce_sum`) really exchange values between the rank threads through a barrier, so the real
agreement and gather code runs unmodified, thousands of times per second. A rank that never joins a
collective makes the others fail with BrokenBarrierError after `timeout_s` (a hang becomes an error); one that leaves
(`ThreadWorld.abort`: its process died, its sockets closed) makes every collective fail at once, as gloo's do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class ThreadWorld:
    def __init__(self, world_size: int, timeout_s: float = 10.0) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._slots: list[object] = [None] * world_size

    def exchange(self, rank: int, value: object) -> list[object]:
        """Every rank's value, in rank order (a collective: every rank must call it)."""
        self._slots[rank] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read them
        return values

    def abort(self) -> None:
        """A rank left: every collective waiting, and every later one, raises BrokenBarrierError at once."""
        self._barrier.abort()

    def ranks(self) -> list[ThreadRank]:
        return [ThreadRank(r, self.world_size, self) for r in range(self.world_size)]

    def run(self, fn: Callable[[ThreadRank], object]) -> list[tuple[str, object]]:
        """fn(rank) on every rank in its own thread; per rank ("ok", value) or ("error", exception)."""
        results: list[tuple[str, object]] = [("error", TimeoutError("rank did not finish"))] * self.world_size

        def body(rank: ThreadRank) -> None:
            try:
                results[rank.rank] = ("ok", fn(rank))
            except BaseException as error:  # noqa: BLE001 - recorded for the caller to judge
                results[rank.rank] = ("error", error)  # ranks still waiting on it time out

        threads = [threading.Thread(target=body, args=(r,)) for r in self.ranks()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


@dataclass
class ThreadRank:
    """Duck-types the parts of `TPGroup` the capacity agreement and encoder DP use."""

    rank: int
    world_size: int
    world: ThreadWorld
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def min_int(self, value: int) -> int:
        return min(self.world.exchange(self.rank, value))  # type: ignore[type-var]

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [x.clone() for x in self.world.exchange(self.rank, t)]  # type: ignore[union-attr]

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        total = sum(x.clone() for x in self.world.exchange(self.rank, t))  # type: ignore[misc]
        t.copy_(total)
        return t
