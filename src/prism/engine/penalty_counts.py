"""The output counts the penalties read, kept on the device between steps: `PenaltyCounts`, one table per device and
vocabulary, whose rows ("slots") belong to penalized requests.

Owns *a slot counts its request's history exactly once, and only a running request holds one*: a request's slot is
zeroed when the request takes it (its first penalized sample since it last started running), filled then from its
whole output (and its prompt's tokens, for a repetition penalty), and afterwards given, at each sample, only the
tokens appended since its last one (`CountsSlot.counted`: one per step usually; more under async scheduling, where
the step in flight's token is appended before the next step samples). So row i of the table always equals a recount
of output[:counted] of the request holding it. The slot goes back whenever its request stops running (`Request.
transition`: preempted, swapped out or dropped to recompute, or finished, however it ends), or when the request is
garbage collected (a `weakref.finalize` on the slot handle); a resumed request takes a fresh slot at its next
penalized sample, refilled from its whole history. So the slots in use are those of the requests running.

Cost of a step: rows times their new tokens, not their histories. The host checks and stages the new tokens' flat
positions (with the caller's own positions, e.g. logit_bias entries) in ONE host->device copy; the device runs one
scatter_add for every row and one index_select for the step's rows (plus a zeroing of the slots taken this step, and
a prompt fill for a new repetition slot). Memory: int32 [capacity, vocab] counts (608 KB a slot at Qwen3-VL's
151,936 tokens), and a bool [capacity, vocab] prompt plane once a repetition penalty appears; capacity doubles when
the slots run out and never shrinks. Row 0 is never given out: always zero, it is what rows without a penalty
gather.

A table's updates run under its lock, and every step enqueues its kernels on its thread's current stream of the
device (Prism's engines all use the default one), so the device applies them in the order the lock gave them.
Releases never take the lock (a finalizer may run inside a locked step, on any thread): they append the index to a
queue the next step drains.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..ops import host_copy
from .sampling import SamplerError


class History(Protocol):
    """What a slot is filled from (`penalties.TokenHistory`)."""

    prompt: Sequence[int] | np.ndarray
    output: Sequence[int] | np.ndarray
    counts: CountsSlot | None


class CountsSlot:
    """One request's row of a `PenaltyCounts` table: which table and row, how many of its output tokens the row
    counts, whether its prompt plane is filled. Unbound until its first penalized sample; `release` gives the row
    back (and the next sample, if any, takes a fresh one)."""

    __slots__ = ("table", "index", "counted", "prompt_filled", "_give_back", "__weakref__")

    def __init__(self) -> None:
        self.table: PenaltyCounts | None = None
        self.index = 0
        self.counted = 0
        self.prompt_filled = False
        self._give_back: weakref.finalize | None = None

    def release(self) -> None:
        """Give the row back to its table (idempotent)."""
        if self._give_back is not None:
            self._give_back()  # a finalize runs its callback once: a later collection gives nothing back again
        self.table, self._give_back, self.index, self.counted, self.prompt_filled = None, None, 0, 0, False


@dataclass(frozen=True)
class StepCounts:
    """One step's rows as the table holds them after the step's tokens: `counts` [n, V] int32 (zero for a row
    without penalties), `prompt_seen` [n, V] bool (its prompt's tokens, for a repetition penalty; None when no row
    has one) and `extra`, the caller's int64 values, on the device."""

    counts: torch.Tensor
    prompt_seen: torch.Tensor | None
    extra: torch.Tensor


_TABLES: dict[tuple[torch.device, int], PenaltyCounts] = {}
_TABLES_LOCK = threading.Lock()


def table_for(device: torch.device, vocab: int) -> PenaltyCounts:
    """The process's table for `device` and `vocab`, made the first time a penalized row is sampled there."""
    key = (torch.device(device), vocab)
    table = _TABLES.get(key)
    if table is None:
        with _TABLES_LOCK:
            table = _TABLES.get(key)
            if table is None:
                table = _TABLES[key] = PenaltyCounts(*key)
    return table


class PenaltyCounts:
    """Output counts int32 [capacity, vocab] on `device`, row 0 always zero, the others given to requests as slots;
    `prompt_seen` bool [capacity, vocab], made with the first repetition penalty."""

    def __init__(self, device: torch.device | str, vocab: int, capacity: int = 8) -> None:
        if vocab < 1 or capacity < 2:
            raise ValueError(f"a PenaltyCounts needs vocab >= 1 and capacity >= 2, got {vocab} and {capacity}")
        self.device = torch.device(device)
        self.vocab = vocab
        self.counts = torch.zeros(capacity, vocab, dtype=torch.int32, device=self.device)
        self.prompt_seen: torch.Tensor | None = None
        self.lock = threading.Lock()
        self._free = list(range(capacity - 1, 0, -1))  # pop() takes the lowest
        self._released: deque[int] = deque()  # appended by releases (any thread, finalizers included)
        self._one = torch.ones(1, dtype=torch.int32, device=self.device)

    @property
    def capacity(self) -> int:
        return self.counts.shape[0]

    @property
    def in_use(self) -> int:
        """Slots held by requests (released ones not yet drained are not)."""
        return self.capacity - 1 - len(self._free) - len(self._released)

    def step(self, histories: Sequence[History | None], repetition: Sequence[bool], extra: np.ndarray) -> StepCounts:
        """Bring the slot of each row with a history up to date with its tokens (taking one when it has none: a
        history without a `counts` handle gets one for this step only) and gather the rows, in order."""
        with self.lock:
            plan = _Update.of(self, histories, repetition)
            touched = [s for s in plan.slots if s is not None]
            try:
                return self._apply(plan, extra)
            except BaseException:
                for s in touched:  # their rows may be half written: the next sample refills them from scratch
                    s.release()
                raise
            finally:
                for s in plan.ephemeral:
                    s.release()

    def _apply(self, plan: _Update, extra: np.ndarray) -> StepCounts:
        self._drain()
        taken = len(plan.fresh)
        if taken > len(self._free):
            self._grow(taken - len(self._free))
        if any(plan.repetition) and self.prompt_seen is None:
            self.prompt_seen = torch.zeros(self.capacity, self.vocab, dtype=torch.bool, device=self.device)
        for slot in plan.fresh:
            self._take(slot)
        ints = plan.ints(self.vocab)
        n = len(plan.slots)
        at = host_copy.to_device(np.concatenate([ints.values, extra]), self.device, torch.int64)
        new_at, rows, fresh, prompt_at, extra_at = at.split([ints.num_new, n, taken, ints.num_prompt, len(extra)])
        if taken:
            self._zero(fresh)
        if ints.num_prompt:
            self.prompt_seen.view(-1).index_fill_(0, prompt_at, True)
        if ints.num_new:
            self.counts.view(-1).scatter_add_(0, new_at, self._one.expand(ints.num_new))
        plan.commit()
        seen = self.prompt_seen.index_select(0, rows) if any(plan.repetition) else None
        return StepCounts(self.counts.index_select(0, rows), seen, extra_at)

    def _drain(self) -> None:
        while self._released:
            self._free.append(self._released.popleft())

    def _grow(self, short: int) -> None:
        """Double the capacity (more if `short` rows more are needed), copying the rows held."""
        old = self.capacity
        new = old * 2
        while new - old < short:
            new *= 2
        counts = torch.zeros(new, self.vocab, dtype=torch.int32, device=self.device)
        counts[:old].copy_(self.counts)
        self.counts = counts
        if self.prompt_seen is not None:
            seen = torch.zeros(new, self.vocab, dtype=torch.bool, device=self.device)
            seen[:old].copy_(self.prompt_seen)
            self.prompt_seen = seen
        self._free[:0] = range(new - 1, old - 1, -1)  # below the free ones: pop() still takes the lowest first

    def _take(self, slot: CountsSlot) -> None:
        slot.release()  # bound to another table, or to a row counting more than its history now holds
        index = self._free.pop()
        slot.table, slot.index, slot.counted, slot.prompt_filled = self, index, 0, False
        slot._give_back = weakref.finalize(slot, self._released.append, index)
        slot._give_back.atexit = False

    def _zero(self, rows: torch.Tensor) -> None:
        """Zero the rows taken this step (a released row keeps its last owner's counts until then)."""
        self.counts.index_fill_(0, rows, 0)
        if self.prompt_seen is not None:
            self.prompt_seen.index_fill_(0, rows, False)


@dataclass
class _Ints:
    """The host int64 values of an update, in the order `PenaltyCounts._apply` splits them: the flat table position
    of each new token, the row of each of the step's rows, the rows taken this step, the flat position of each
    prompt token to mark."""

    values: np.ndarray
    num_new: int
    num_prompt: int


@dataclass
class _Update:
    """What a step does to the table, decided (and every token id checked) before anything is changed."""

    slots: list[CountsSlot | None]
    histories: list[History | None]
    repetition: list[bool]
    fresh: list[CountsSlot]  # the slots to take (unbound, bound elsewhere, or whose history shrank)
    ephemeral: list[CountsSlot]  # taken for this step only (a history without a handle)
    new_tokens: np.ndarray  # the tokens each slot has not counted, row after row
    new_lengths: list[int]
    prompts: list[np.ndarray]  # the prompt tokens of each slot whose prompt plane is to be filled
    prompt_slots: list[CountsSlot]

    @classmethod
    def of(cls, table: PenaltyCounts, histories: Sequence[History | None], repetition: Sequence[bool]) -> _Update:
        vocab = table.vocab
        update = cls([], list(histories), list(repetition), [], [], np.empty(0, np.int64), [], [], [])
        tokens: list[int] = []
        in_step: set[int] = set()
        for history, rep in zip(histories, repetition, strict=True):
            if history is None:
                update.slots.append(None)
                update.new_lengths.append(0)
                continue
            slot = history.counts
            if slot is None:
                slot = CountsSlot()
                update.ephemeral.append(slot)
            update.slots.append(slot)
            first = id(slot) not in in_step
            in_step.add(id(slot))
            fresh = slot.table is not table or len(history.output) < slot.counted
            if fresh and first:
                update.fresh.append(slot)
            start = 0 if fresh else slot.counted
            new = history.output[start:] if first else ()
            tokens.extend(new)
            update.new_lengths.append(len(new))
            if rep and first and (fresh or not slot.prompt_filled):
                update.prompts.append(_in_vocab(history.prompt, vocab, "prompt"))
                update.prompt_slots.append(slot)
        update.new_tokens = _in_vocab(tokens, vocab, "output")
        return update

    def ints(self, vocab: int) -> _Ints:
        """The host values once the fresh slots are taken (their rows known)."""
        indices = np.asarray([0 if s is None else s.index for s in self.slots], dtype=np.int64)
        new_at = self.new_tokens + np.repeat(indices * vocab, self.new_lengths)
        fresh = np.asarray([s.index for s in self.fresh], dtype=np.int64)
        prompt_at = [p + s.index * vocab for p, s in zip(self.prompts, self.prompt_slots, strict=True)]
        return _Ints(np.concatenate([new_at, indices, fresh, *prompt_at]), len(new_at), sum(len(p) for p in prompt_at))

    def commit(self) -> None:
        """Record what the slots now count, once the update is on the device."""
        for slot, history in zip(self.slots, self.histories, strict=True):
            if slot is not None:
                slot.counted = len(history.output)
        for slot in self.prompt_slots:
            slot.prompt_filled = True


def _in_vocab(tokens: Sequence[int] | np.ndarray, vocab: int, what: str) -> np.ndarray:
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise SamplerError(f"a {what} token id of a penalized row is outside the vocabulary of {vocab}")
    return ids
