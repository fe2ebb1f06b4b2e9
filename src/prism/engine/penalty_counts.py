"""The output counts the penalties read, kept on the device between steps: `PenaltyCounts`, one table per engine
(`Engine.penalty_counts`), whose rows ("slots") belong to the penalized requests running.

Owns *a slot counts its request's history exactly once, and only a running request holds one*: a request's slot is
zeroed when the request takes it (its first penalized sample since it last started running), filled then from its
whole output (and its prompt's tokens, for a repetition penalty), and afterwards given, at each sample, only the
tokens appended since its last one (`CountsSlot.counted`: one per step usually; more under async scheduling, where
the step in flight's token is appended before the next step samples). So row i of the table always equals a recount
of output[:counted] of the request holding it. The slot goes back whenever its request stops running (`Request.
transition`: preempted, swapped out or dropped to recompute, or finished, however it ends), or when the request is
garbage collected (a `weakref.finalize` on the slot handle); a resumed request takes a fresh slot at its next
penalized sample, refilled from its whole history. The scheduler runs at most `max_num_seqs` requests at a time
(under async scheduling too: a request whose token in flight ends it gives its seat away only once that token has
finished it, before the step it made room for samples), so the slots in use never exceed `max_num_seqs`: a table of
that many slots never runs out (`PenaltyTableFull` if it does: a slot leaked).

A release never touches the counts a sampled step needs: a step's rows are gathered (copied out of the table) when
it samples, on the stream every later step's writes follow, and the engine preempts only when no step is in flight
(the scheduler's preempting schedule runs once the host has read every sampled token; a step scheduled ahead
preempts no one).

Cost of a step: rows times their new tokens, not their histories. The host checks and stages the new tokens' flat
positions (with the caller's own positions, e.g. logit_bias entries) in ONE host->device copy; the device runs one
scatter_add for every row and one index_select for the step's rows (plus a zeroing of the slots taken this step, and
a prompt fill for a new repetition slot). Memory, fixed: int32 counts and a bool prompt plane, [slots + 1, vocab]
each (5 bytes a token a row: 760 KB a slot at Qwen3-VL's 151,936 tokens), allocated whole the first time a penalized
row samples (logged; `PenaltyTableOutOfMemory` if the device has no room for it) and kept. Row 0 is never given
out: always zero, it is what rows without a penalty gather.

A table's updates run under its lock, and every step enqueues its kernels on its thread's current stream of the
device (Prism's engines all use the default one), so the device applies them in the order the lock gave them.
Releases never take the lock (a finalizer may run inside a locked step, on any thread): they append the index to a
queue the next step drains.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)


class PenaltyTableOutOfMemory(RuntimeError):
    """The device had no room for the count table when a penalized row first sampled: the engine fails that step's
    penalized requests with it (the others sample on)."""


class PenaltyTableFull(RuntimeError):
    """A step needs more slots than the table has: more penalized requests hold one than can run at a time (a slot
    kept by a request that stopped running), or a direct caller's table too small for its rows."""


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


class PenaltyCounts:
    """Output counts int32 [slots + 1, vocab] on `device`, row 0 always zero, the others given to requests as slots,
    and `prompt_seen` bool [slots + 1, vocab], the prompt tokens of those with a repetition penalty; both None until
    the first penalized row samples."""

    def __init__(self, device: torch.device | str, vocab: int, slots: int) -> None:
        if vocab < 1 or slots < 1:
            raise ValueError(f"a PenaltyCounts needs vocab >= 1 and slots >= 1, got {vocab} and {slots}")
        self.device = torch.device(device)
        self.vocab = vocab
        self.slots = slots
        self.counts: torch.Tensor | None = None
        self.prompt_seen: torch.Tensor | None = None
        self.lock = threading.Lock()
        self._free = list(range(slots, 0, -1))  # pop() takes the lowest
        self._released: deque[int] = deque()  # appended by releases (any thread, finalizers included)
        self._one = torch.ones(1, dtype=torch.int32, device=self.device)

    @property
    def capacity(self) -> int:
        """Rows, row 0 included."""
        return self.slots + 1

    @property
    def nbytes(self) -> int:
        """The device memory the table takes once allocated: 4 bytes of count and 1 of prompt plane a token a row."""
        return self.capacity * self.vocab * 5

    @property
    def in_use(self) -> int:
        """Slots held by requests (released ones not yet drained are not)."""
        return self.slots - len(self._free) - len(self._released)

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
        for slot in plan.fresh:  # bound to another table, or to a row counting more than its history now holds
            slot.release()
        self._drain()
        taken = len(plan.fresh)
        if taken > len(self._free):
            raise PenaltyTableFull(f"a step takes {taken} slots of the penalty count table, {len(self._free)} of its "
                                   f"{self.slots} are free: its slots are for the requests running at a time")
        if self.counts is None:
            self._allocate()
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

    def _allocate(self) -> None:
        """The whole table, once: its size is known from the start (`nbytes`), never grown at run time."""
        shape = (self.capacity, self.vocab)
        try:
            counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        except torch.OutOfMemoryError as error:
            raise PenaltyTableOutOfMemory(
                f"no room on {self.device} for the penalty count table ({self.nbytes / 2**20:.1f} MiB: {self.slots} "
                f"slots (max_num_seqs) + 1, x {self.vocab} tokens x 5 bytes): leave that much free beside the KV "
                "pool (lower kv_memory_bytes or max_num_seqs)") from error
        self.counts, self.prompt_seen = counts, seen
        log.info("penalty count table allocated on %s: %d slots + 1 x %d tokens x 5 bytes = %d bytes (%.1f MiB)",
                 self.device, self.slots, self.vocab, self.nbytes, self.nbytes / 2**20)

    def _drain(self) -> None:
        while self._released:
            self._free.append(self._released.popleft())

    def _take(self, slot: CountsSlot) -> None:
        index = self._free.pop()
        slot.table, slot.index, slot.counted, slot.prompt_filled = self, index, 0, False
        slot._give_back = weakref.finalize(slot, self._released.append, index)
        slot._give_back.atexit = False

    def _zero(self, rows: torch.Tensor) -> None:
        """Zero the rows taken this step (a released row keeps its last owner's counts until then)."""
        self.counts.index_fill_(0, rows, 0)
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
