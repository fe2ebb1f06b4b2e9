"""Async scheduling: what the step launched while another is in flight may carry.

Owns *a continuation is the step the scheduler would schedule, only earlier*. While a step's sampled tokens are
still on the device (`inflight.InflightStep`), the engine may launch the next step without scheduling: the decode
rows of the same sequences, fed those tokens on the device, each position held as a pending token by the KV
manager; and, when the one running request not decoding is the youngest and still in its prompt (a prompt
interleaved beside decodes, `interleave_prefill_tokens`), its next chunk, packed after the rows. That chunk is the
one `Scheduler.chunk_end` gives it after the rows' tokens (same budget, same interleave limit, same order), so the
tokens are those of scheduled steps. Anything else (a request waiting that could be admitted, one swapped out, a
pending transfer, a page that needs copying or preempting, a step the graphs do not replay) returns an empty
continuation and the step is scheduled normally.

When requests wait to be admitted (many clients: a request ends and the next one arrives every step or two), the
scheduler itself runs ahead (`rows_scheduled_ahead`): every running request is a decode row of the step in flight,
so with their pending slots reserved first the scheduler sees each as a one-token decode whose pages it already
has (and is told not to preempt); it admits and chunks the waiting requests as it would a step later. Rows whose
token in flight ends them by length are skipped, their seats given to waiting requests (the sequences of the step
stay within `max_num_seqs`; `scheduler.running` holds them until that token is read, right after the launch).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kv.manager import KVCacheManager
from .inflight import InflightStep
from .request import Request, RequestState
from .scheduler import ScheduledSlice, Scheduler


@dataclass
class Continuation:
    """Decode rows fed the in-flight step's tokens on the device, as (sampling row of that step, slice), and at
    most one prefill chunk, packed after them."""

    rows: list[tuple[int, ScheduledSlice]]
    chunk: ScheduledSlice | None = None

    @property
    def slices(self) -> list[ScheduledSlice]:
        return [s for _, s in self.rows] + ([self.chunk] if self.chunk is not None else [])


def decoding_rows(current: InflightStep) -> list[tuple[int, Request]]:
    """(sampling row of `current`, request) of its requests still running (not aborted or finished meanwhile)."""
    return [(i, s.request) for i, s in enumerate(current.sampled) if s.request.state is RequestState.RUNNING]


def plan_continuation(current: InflightStep, scheduler: Scheduler, kv: KVCacheManager, runner,
                      max_model_len: int) -> Continuation:
    """The continuation of `current` with its pages reserved (pending tokens for the rows), or an empty one."""
    none = Continuation([])
    if scheduler.swapped or not kv.plan.is_empty():
        return none
    rows = decoding_rows(current)
    ending = sum(1 for _, r in rows if stops_by_length_after_next(r, max_model_len))
    if scheduler.waiting and len(scheduler.running) - ending < scheduler.config.max_num_seqs:
        return none  # a seat is free, or frees once the tokens in flight are read: admit first
    prefilling = None
    if len(rows) != len(scheduler.running):  # someone running is not decoding in this step
        prefilling = chunk_continuing(scheduler, kv, rows)
        if prefilling is None:
            return none
    rows = [(i, r) for i, r in rows if not stops_by_length_after_next(r, max_model_len)]
    if not rows:
        return none
    seqs = [kv.seqs[r.request_id] for _, r in rows]
    longest = max(len(seq.content) for seq in seqs) + 1
    chunk = reservation = None
    if prefilling is None:
        if not runner.replays_decode_rows(len(rows), longest):
            return none
    else:
        seq = kv.seqs[prefilling.request_id]
        budget = scheduler.config.max_num_batched_tokens - len(rows)
        end = scheduler.chunk_end(prefilling, seq.content, seq.num_computed, budget, decoding=True)
        if end <= seq.num_computed or not runner.replays_chunk_beside_rows(
                len(rows), end - seq.num_computed, max(longest, end)):
            return none
        chunk = ScheduledSlice(prefilling, seq.num_computed, end)
        reservation = (prefilling.request_id, end - seq.num_computed)
    if not kv.reserve_pending([r.request_id for _, r in rows], chunk=reservation):
        return none
    decode = [(i, ScheduledSlice(r, seq.num_computed, seq.num_computed + 1))
              for (i, r), seq in zip(rows, seqs, strict=True)]
    return Continuation(decode, chunk)


def chunk_continuing(scheduler: Scheduler, kv: KVCacheManager, rows: list[tuple[int, Request]]) -> Request | None:
    """The running request whose next prefill chunk may go beside `rows`: the only one not decoding, the youngest
    (the scheduler puts it after the decodes), in its prompt, plain (no branches or readout, which commit
    differently). None if there is no such request."""
    decoding = {r.request_id for _, r in rows}
    others = [r for r in scheduler.running if r.request_id not in decoding]
    if len(others) != 1 or not rows:
        return None
    (request,) = others
    seq = kv.seqs.get(request.request_id)
    if (request.state is not RequestState.RUNNING or seq is None or request.output_token_ids
            or seq.num_computed >= request.num_prompt_tokens or request.branches is not None
            or request.readout_candidates is not None or request.priority < max(r.priority for _, r in rows)):
        return None
    return request


def stops_by_length_after_next(request: Request, max_model_len: int) -> bool:
    """Whether the token in flight ends `request` by length (no next step to launch for it)."""
    n = len(request.output_token_ids) + 1
    return n >= request.params.max_tokens or request.num_prompt_tokens + n >= max_model_len


def rows_scheduled_ahead(current: InflightStep, scheduler: Scheduler, kv: KVCacheManager,
                         max_model_len: int) -> tuple[list[tuple[int, Request]], set[str]] | None:
    """For the scheduler to run while `current` is in flight: (the decode rows, as (sampling row of `current`,
    request), their pending slots reserved; the running requests to skip, whose token in flight ends them). None
    when the step must wait for `current`'s tokens: nobody waiting, someone swapped or running but not decoding
    in `current`, no row left to decode (the scheduler would then see no decodes), a pending transfer, or a slot
    that needs copying or preempting."""
    if not scheduler.waiting or scheduler.swapped or not kv.plan.is_empty():
        return None
    rows = decoding_rows(current)
    if len(rows) != len(scheduler.running):
        return None
    skip = {r.request_id for _, r in rows if stops_by_length_after_next(r, max_model_len)}
    live = [(i, r) for i, r in rows if r.request_id not in skip]
    if not live or len(live) > scheduler.config.max_num_batched_tokens:  # (nobody decodes / some left out)
        return None
    if not kv.reserve_pending([r.request_id for _, r in live]):
        return None
    return live, skip


def samples_at_launch(slices: list[ScheduledSlice], pending) -> list[bool]:
    """Which slices of a step scheduled ahead sample: those that end their request's known tokens, and every decode
    row fed a device token (`pending`: its token is not read yet, so its slice does not look like the last one)."""
    return [s.sample or s.request.request_id in pending for s in slices]
