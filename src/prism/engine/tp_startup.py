"""Tensor-parallel start-up: the ranks meet at each stage through rank 0's store, rank 0 watching the followers live.

Owns *a follower that dies while the ranks start fails rank 0 at once, naming it*. Inside torch.distributed only
`distributed_timeout_s` (300 s by default) would end rank 0's wait for a dead follower: the rendezvous waits for
every rank to check in, and an NCCL collective need not notice that a peer died (gloo's does, once the peer's
sockets close). So before each point where rank 0 would wait on the followers there, every follower reports
reaching a stage (a key in the store rank 0 hosts) and rank 0 waits for those reports, polling the follower
processes' exit codes: JOINING, just before the ranks form the group (`tp_workers.join_group`), and LOADED, once
a rank has loaded and sharded its model, before its first collective (`rank.build_rank_runner`). A follower that
has exited ends the wait with a `TensorParallelFailure` naming it and its exit code; the caller stops the others.
One that dies after LOADED, inside the first collectives (the KV page agreement, CUDA graph capture), is seen by
gloo's collective at once, by NCCL's possibly only when `distributed_timeout_s` runs out.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

JOINING = "joining"
LOADED = "loaded"
STAGES = {JOINING: "joined the tensor-parallel group", LOADED: "loaded its model"}
POLL_S = 0.05


class TensorParallelFailure(RuntimeError):
    """A tensor-parallel rank failed or left: the ranks can no longer run the same steps."""


class Process(Protocol):
    @property
    def exitcode(self) -> int | None: ...


def exit_description(code: int) -> str:
    """'exited with code -9 (SIGKILL)': a negative code is the signal that ended the process."""
    if code < 0:
        try:
            return f"exited with code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exited with code {code}"


def exited(processes: Sequence[Process]) -> list[str]:
    """'rank r exited with code c' for each follower (rank r is processes[r - 1]) that has ended."""
    return [f"rank {rank} {exit_description(p.exitcode)}" for rank, p in enumerate(processes, 1)
            if p.exitcode is not None]


def wait_for_followers(stage: str, reached: Callable[[int], bool], processes: Sequence[Process], timeout_s: float,
                       *, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                       poll_s: float = POLL_S) -> None:
    """Return once every follower has `reached` the stage. Raise `TensorParallelFailure` at the first poll that
    finds a follower exited (none exits while the ranks start), or once `timeout_s` has passed."""
    deadline = clock() + timeout_s
    waiting = list(range(1, len(processes) + 1))
    while True:
        dead = exited(processes)
        if dead:
            raise TensorParallelFailure(f"tensor-parallel start failed: {'; '.join(dead)} before every rank "
                                        f"{STAGES[stage]}; the other ranks were stopped")
        waiting = [rank for rank in waiting if not reached(rank)]
        if not waiting:
            return
        if clock() >= deadline:
            raise TensorParallelFailure(f"tensor-parallel start failed: rank(s) {waiting} had not "
                                        f"{STAGES[stage]} after {timeout_s:g} s (distributed_timeout_s); the other "
                                        "ranks were stopped")
        sleep(poll_s)


def _key(stage: str, rank: int) -> str:
    return f"prism-start/{stage}/{rank}"


class Rendezvous:
    """Rank 0's side: the store every rank forms the group through (made before the followers are spawned, so they
    find it listening), and the waits at each stage. `processes`: the followers, once spawned."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.timeout_s = timeout_s
        self.processes: Sequence[Process] = ()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.store.port}"

    def close(self) -> None:
        """Drop this side's store (its port closes once the group that shares it is gone too). Idempotent."""
        self.store = None

    def reach(self, stage: str) -> None:
        """Wait until every follower has reached `stage` (`wait_for_followers`)."""
        wait_for_followers(stage, lambda rank: self.store.check([_key(stage, rank)]), self.processes,
                           self.timeout_s)


class FollowerRendezvous:
    """A follower's side: its connection to rank 0's store, and its reports."""

    def __init__(self, rank: int, address: str, timeout_s: float) -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.rank = rank
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))

    def reach(self, stage: str) -> None:
        """Tell rank 0 this rank has reached `stage`."""
        self.store.set(_key(stage, self.rank), "1")
