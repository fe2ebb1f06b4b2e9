"""Tensor-parallel start-up: the ranks meet at each stage through rank 0's store, rank 0 watching the followers live.

Owns *a follower that dies or fails at any point of its start fails rank 0's start at once, naming it*, and *rank 0's
start returns only once every follower has finished its own*. Inside torch.distributed only `distributed_timeout_s`
(300 s by default) would end rank 0's wait for a dead follower: the rendezvous waits for every rank to check in, and
an NCCL collective need not notice that a peer died (gloo's does, once the peer's sockets close). So before each
point where rank 0 would wait on the followers there, every follower reports reaching a stage (a key in the store
rank 0 hosts) and rank 0 waits for those reports, polling the follower processes' exit codes and the errors they
report: JOINING, just before the ranks form the group (`tp_workers.join_group`); LOADED, once a rank has loaded and
sharded its model, before its first collective; READY, once a rank has finished its start (KV pools, warm-up, CUDA
graphs: `rank.finish_start`), the last thing rank 0 does before its engine is returned. A follower whose start raises
reports its error (`FollowerRendezvous.reporting`) before it leaves the group and exits; one that has exited or
reported ends the wait with a `TensorParallelFailure` naming it and its error or exit code; the caller stops the
others. One that dies between LOADED and READY while rank 0 is inside a collective (the KV page agreement, CUDA graph
capture) is seen by gloo's collective at once (the caller then names it, `Rendezvous.failures_within`), by NCCL's
possibly only when `distributed_timeout_s` runs out. After the start, `failed` (their exits) is what tells rank 0, before each step
and on `/health`, that a follower has died while the engine was idle (`tp_workers.Followers.check_alive`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

log = logging.getLogger(__name__)

JOINING = "joining"
LOADED = "loaded"
READY = "ready"
STAGES = {JOINING: "joined the tensor-parallel group", LOADED: "loaded its model", READY: "finished its start"}
POLL_S = 0.05
# How long a rank-0 error (a collective that broke because a follower died inside it) waits to learn which follower
# failed and why: the follower reports its error before it leaves the group, and a killed one is reaped a moment
# after its sockets close. Only when no follower is known to have failed yet (rank 0's own error waits it out).
FAILURE_GRACE_S = 2.0
SETTLE_S = 0.2
ERROR_CHARS = 500


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


def no_errors(rank: int) -> str | None:
    return None


def failed(processes: Sequence[Process], error_of: Callable[[int], str | None] = no_errors) -> list[str]:
    """'rank r failed: <its error> (exited with code c)', or 'rank r exited with code c', for each follower (rank r is
    processes[r - 1]) that reported an error (`error_of(r)`: what `FollowerRendezvous.reporting` stored, None if
    nothing; by default only the exits are looked at) or has ended."""
    found = []
    for rank, p in enumerate(processes, 1):
        code = p.exitcode  # first: a follower reports before it exits, so one seen exited has its report seen too
        error = error_of(rank)
        if error is not None:
            found.append(f"rank {rank} failed: {error}" + (f" ({exit_description(code)})" if code is not None else ""))
        elif code is not None:
            found.append(f"rank {rank} {exit_description(code)}")
    return found


def settled(found_now: Callable[[], list[str]], count: int, clock: Callable[[], float],
            sleep: Callable[[float], None], poll_s: float) -> list[str]:
    """Once a follower is found failed, `found_now()` polled `SETTLE_S` more (or until all `count` have failed): the
    followers inside the collective it broke fail too, and one may report before the first one's exit is seen; the
    error names them all, the first among them."""
    deadline = clock() + SETTLE_S
    found = found_now()
    while len(found) < count and clock() < deadline:
        sleep(poll_s)
        found = found_now()
    return found


def wait_for_followers(stage: str, reached: Callable[[int], bool], processes: Sequence[Process], timeout_s: float,
                       *, error_of: Callable[[int], str | None] = no_errors,
                       clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                       poll_s: float = POLL_S) -> None:
    """Return once every follower has `reached` the stage. Raise `TensorParallelFailure` at the first poll that
    finds a follower exited or reporting an error (`failed`; none does while the ranks start), or once `timeout_s`
    has passed."""
    deadline = clock() + timeout_s
    waiting = list(range(1, len(processes) + 1))
    while True:
        dead = failed(processes, error_of)
        if dead:
            dead = settled(lambda: failed(processes, error_of), len(processes), clock, sleep, poll_s)
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


def _error_key(rank: int) -> str:
    return f"prism-start/failed/{rank}"


def describe_error(error: BaseException) -> str:
    """'TypeName: first line of its message', at most ERROR_CHARS characters (what a follower reports)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


class Rendezvous:
    """Rank 0's side: the store every rank forms the group through (made before the followers are spawned, so they
    find it listening), and the waits at each stage. `processes`: the followers, once spawned."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.timeout_s = timeout_s
        self.poll_s = POLL_S
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
                           self.timeout_s, error_of=self.error_of, poll_s=self.poll_s)

    def error_of(self, rank: int) -> str | None:
        """The error follower `rank` reported (`FollowerRendezvous.reporting`), None if none (or the store is gone)."""
        store = self.store
        if store is None or not store.check([_error_key(rank)]):
            return None
        return store.get(_error_key(rank)).decode(errors="replace")

    def failures_within(self, grace_s: float = FAILURE_GRACE_S) -> list[str]:
        """The followers that failed (`failed`), polling up to `grace_s` while none is known to have, then
        `settled`: what a rank-0 error names when a collective broke because a follower died or raised inside it."""
        deadline = time.monotonic() + grace_s
        while not failed(self.processes, self.error_of) and time.monotonic() < deadline:
            time.sleep(self.poll_s)
        return settled(lambda: failed(self.processes, self.error_of), len(self.processes), time.monotonic,
                       time.sleep, self.poll_s)


class FollowerRendezvous:
    """A follower's side: its connection to rank 0's store, and its reports."""

    def __init__(self, rank: int, address: str, timeout_s: float) -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.rank = rank
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))

    def reach(self, stage: str) -> None:
        """Tell rank 0 this rank has reached `stage`."""
        self.store.set(_key(stage, self.rank), "1")

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """Report an error raised inside to rank 0 (`Rendezvous.error_of`), then let it go on: rank 0's start fails
        naming it, not only this process's exit code. Reporting is best effort: a store already gone is logged."""
        try:
            yield
        except Exception as error:
            try:
                self.store.set(_error_key(self.rank), describe_error(error))
                self.store.check([_error_key(self.rank)])  # a round trip: the store has it before this rank exits
            except Exception:  # rank 0 is gone (its store with it): nobody to tell
                log.warning("rank %d could not report its error to rank 0", self.rank, exc_info=True)
            raise
