"""Transfer plans: the page moves one step needs before the model runs, and their one executor.

Owns *transfer order = snapshot semantics* (invariant 5). A plan has four kinds of moves, executed in the
fixed order swap-in -> swap-out -> copy-prefix -> copy-on-write (then the model). The planner may reuse,
inside one plan, a slot freed by an earlier-executing move (a GPU page swapped out becomes a CoW target),
so the order is part of the meaning. `validate` proves a plan has snapshot semantics under that order:
no move writes a page that the same or an earlier-executing move reads, and no two moves write the same
page; executing it then equals applying every move to a snapshot of the pools taken before the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from ..ops.page_copy import copy_page_rows, swap_pages
from .fp8 import KVPool

PoolName = Literal["gpu", "cpu"]
Slot = tuple[PoolName, int]

EXECUTION_ORDER = ("swap_in", "swap_out", "copy_prefix", "copy_on_write")


class PlanConflict(RuntimeError):
    """A move would break snapshot semantics (read-after-write or write-write inside one plan)."""


@dataclass(frozen=True)
class Move:
    kind: str
    src: Slot
    dst: Slot
    rows: int | None = None  # copy_prefix only: how many leading rows


@dataclass
class TransferPlan:
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu page, gpu page)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu page, cpu page)
    copy_prefix: list[tuple[int, int, int]] = field(default_factory=list)  # (src, dst, rows), gpu
    copy_on_write: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), gpu
    pinned: list[Slot] = field(default_factory=list)  # pages the plan touches, referenced until it has run
    # How many stages of EXECUTION_ORDER have run to the end (`execute_plan` counts them; it resumes at the first
    # that has not). A lost step's plan is run on from there (`engine/lost_steps.py`): the stages it ran are not run
    # twice, and a stage that raised partway is run again whole, which snapshot semantics makes exact (no move
    # writes what the same or an earlier stage reads, so the stage's sources are as they were). A rank receiving a
    # plan has run none of it.
    stages_run: int = field(default=0, init=False, repr=False, compare=False)
    # What `add` checks a new move against, kept as moves are added so that a plan of n moves is built in O(n)
    # (rechecking the whole plan per move took 3.7 s for one 2,048-page swap): the latest rank each slot is read
    # at, and the rank each slot is written at, for the first `_checked` moves. Derived from the move lists, never
    # given or copied (`dataclasses.replace` makes a plan without them) nor pickled (a follower rank only runs the
    # plan): `add` rebuilds them when the lists hold moves it has not seen.
    _read_rank: dict[Slot, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _write_rank: dict[Slot, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _checked: int = field(default=0, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_read_rank={}, _write_rank={}, _checked=0, stages_run=0)
        return state

    def _num_moves(self) -> int:
        return len(self.swap_in) + len(self.swap_out) + len(self.copy_prefix) + len(self.copy_on_write)

    def _rebuild_check_state(self) -> None:
        self._read_rank, self._write_rank, self._checked = {}, {}, 0
        for move in self.moves():
            self._record(move, _RANK[move.kind])

    def _record(self, move: Move, rank: int) -> None:
        """What later moves are checked against: `move` reads its source and writes its target at `rank`."""
        self._read_rank[move.src] = max(self._read_rank.get(move.src, -1), rank)
        self._write_rank[move.dst] = rank
        self._checked += 1

    def is_empty(self) -> bool:
        return not (self.swap_in or self.swap_out or self.copy_prefix or self.copy_on_write)

    def has_run(self) -> bool:
        """Whether every stage has run (an empty plan has nothing to run)."""
        return self.stages_run == len(EXECUTION_ORDER) or self.is_empty()

    def moves(self) -> list[Move]:
        """Every move, in execution order."""
        return (
            [Move("swap_in", ("cpu", c), ("gpu", g)) for c, g in self.swap_in]
            + [Move("swap_out", ("gpu", g), ("cpu", c)) for g, c in self.swap_out]
            + [Move("copy_prefix", ("gpu", s), ("gpu", d), r) for s, d, r in self.copy_prefix]
            + [Move("copy_on_write", ("gpu", s), ("gpu", d)) for s, d in self.copy_on_write]
        )

    def written(self) -> set[Slot]:
        return {m.dst for m in self.moves()}

    def add(self, move: Move) -> None:
        """Append a move, refusing (PlanConflict) one that would break snapshot semantics: exactly what
        `check_snapshot_semantics` says of the plan's moves with this one, checked in O(1)."""
        rank = _RANK.get(move.kind)
        if rank is None:
            raise ValueError(f"unknown move kind {move.kind!r}")
        if self._checked != self._num_moves():  # moves given to the constructor, or a copy's
            check_snapshot_semantics(self.moves())
            self._rebuild_check_state()
        if move.kind == "copy_prefix" and move.rows is None:
            raise ValueError("a copy_prefix move needs its rows")
        if move.dst in self._write_rank:
            raise PlanConflict(f"{move.kind} writes {move.dst} already written by "
                               f"{EXECUTION_ORDER[self._write_rank[move.dst]]}")
        if move.src == move.dst or self._read_rank.get(move.dst, -1) >= rank:
            raise PlanConflict(f"{move.kind} writes {move.dst}, which a move at or after it reads")
        if rank >= self._write_rank.get(move.src, len(EXECUTION_ORDER)):
            raise PlanConflict(f"{EXECUTION_ORDER[self._write_rank[move.src]]} writes {move.src}, which "
                               f"{move.kind} reads at or after it")
        self._record(move, rank)
        if move.kind == "swap_in":
            self.swap_in.append((move.src[1], move.dst[1]))
        elif move.kind == "swap_out":
            self.swap_out.append((move.src[1], move.dst[1]))
        elif move.kind == "copy_prefix":
            self.copy_prefix.append((move.src[1], move.dst[1], move.rows))
        else:
            self.copy_on_write.append((move.src[1], move.dst[1]))


_RANK = {kind: i for i, kind in enumerate(EXECUTION_ORDER)}


def check_snapshot_semantics(moves: list[Move]) -> None:
    """Raise PlanConflict unless executing `moves` in EXECUTION_ORDER equals reading every source from
    a snapshot: each write must land on a slot no same-or-earlier move reads, and writes must be unique."""
    rank = {kind: i for i, kind in enumerate(EXECUTION_ORDER)}
    last_read: dict[Slot, int] = {}
    writers: dict[Slot, Move] = {}
    for move in moves:
        r = rank[move.kind]
        last_read[move.src] = max(last_read.get(move.src, -1), r)
        if move.dst in writers:
            raise PlanConflict(f"{move.kind} writes {move.dst} already written by {writers[move.dst].kind}")
        writers[move.dst] = move
    for slot, move in writers.items():
        if last_read.get(slot, -1) >= rank[move.kind]:
            raise PlanConflict(f"{move.kind} writes {slot}, which a move at or after it reads")


def execute_plan(plan: TransferPlan, gpu: KVPool, cpu: KVPool | None) -> None:
    """Run the plan's moves on real tensors, in EXECUTION_ORDER, from its first stage not yet run to the end, counting
    each stage in `plan.stages_run` once it has returned (a stage that raises is not counted: run again, it is run
    whole). Payload and scales move together."""

    def idx(values: list[int]) -> torch.Tensor:
        # On the host: the copy functions check the indices there, then move them without a sync.
        return torch.tensor(values, dtype=torch.int64)

    def swap_in() -> None:
        cpu_pages, gpu_pages = zip(*plan.swap_in, strict=True)
        swap_pages(cpu, gpu, idx(list(cpu_pages)), idx(list(gpu_pages)))

    def swap_out() -> None:
        gpu_pages, cpu_pages = zip(*plan.swap_out, strict=True)
        swap_pages(gpu, cpu, idx(list(gpu_pages)), idx(list(cpu_pages)))

    def copy_prefix() -> None:  # page ids as host ints: copy_page_rows checks them there
        src, dst, rows = zip(*plan.copy_prefix, strict=True)
        copy_page_rows(gpu, list(src), list(dst), list(rows))

    def copy_on_write() -> None:
        src, dst = zip(*plan.copy_on_write, strict=True)
        copy_page_rows(gpu, list(src), list(dst), [gpu.layout.page_size] * len(src))

    if (plan.swap_in or plan.swap_out) and cpu is None:
        raise ValueError("the plan swaps pages but there is no CPU swap pool")
    stages = {"swap_in": swap_in, "swap_out": swap_out, "copy_prefix": copy_prefix, "copy_on_write": copy_on_write}
    for number, name in enumerate(EXECUTION_ORDER):
        if number < plan.stages_run:
            continue
        if getattr(plan, name):
            stages[name]()
        plan.stages_run = number + 1
