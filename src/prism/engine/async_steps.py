"""Async scheduling's steps (`EngineConfig.async_scheduling`): the next step launched before the host has read the
tokens of the one in flight, then both committed.

Owns *a step launched ahead commits as the scheduled one would*: the step in flight (`inflight.InflightStep`) commits
its tokens first, then the launched step's slices of requests still live, each sampling slice as judged at launch
(`continuation.samples_at_launch`: a decode row samples although its token is not read yet). When nothing else needs
scheduling, the launched step is the same sequences' next decode rows, fed the in-flight tokens on the device; when
the one request not decoding is the youngest and still in its prompt (a prompt interleaved beside decodes), it also
carries that prompt's next chunk, the one the scheduler would give it: a chunk step's host work then overlaps the
previous step's device time instead of following it (W4: each chunk step waited 2-3 ms of host work,
`bench/host_chunk_steps.py`). With `async_admissions`, when requests wait, the scheduler itself schedules the step
ahead (`continuation.rows_scheduled_ahead`). A sequence that stopped on the token the host just read has one wasted
row, dropped. A launched step that fails is lost alone: the step in flight commits first (`lost_steps`; under tensor
parallelism every rank stops instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import lost_steps
from .continuation import Continuation, plan_continuation, rows_scheduled_ahead, samples_at_launch
from .inflight import InflightStep
from .request import FinishReason
from .scheduler import SchedulerOutput

if TYPE_CHECKING:
    from .engine import Engine


def advance_inflight(engine: Engine) -> None:
    """Launch the next step of the in-flight step's sequences when nothing else needs scheduling (their decode rows,
    and the next prefill chunk of the one request still in its prompt), then commit the in-flight step's tokens
    (waiting for them, not for the launch); the launched step becomes the one in flight."""
    assert engine._inflight is not None
    await_encoding_ahead(engine, engine._inflight)  # (still in flight if the wait raises: nothing is lost)
    current, engine._inflight = engine._inflight, None
    continuation = continuation_of(engine, current)
    if not continuation.rows and schedules_ahead(engine, current):
        return
    rows, chunk = continuation.rows, continuation.chunk
    slices = continuation.slices
    pending = {s.request.request_id for _, s in rows}
    logits = None
    if rows:
        plan = engine.kv.take_plan()  # (no moves: a continuation is planned only when the manager holds none)
        try:
            logits = engine.runner.execute_decode_rows([s for _, s in rows], engine.kv, plan,
                                                       current.device_tokens_of([row for row, _ in rows]), chunk=chunk)
        except Exception as error:  # the launched step is lost, the one in flight is not: commit it, then fail
            lost_steps.fail_a_lost_step(engine, plan, [s.request for s in slices], error, (current, pending))
            return
        except BaseException:  # interrupted: the plan is settled all the same, then the interrupt goes on
            lost_steps.settle_after_an_interrupt(engine, plan)
            raise
        engine.kv.finish_plan(plan)
        engine.stats.async_steps += 1
        engine.stats.async_chunk_steps += chunk is not None
    launched = samples_at_launch(slices, pending)  # every decode row, then the chunk if it ends its prompt
    engine._accept_tokens(current, pending)
    engine._commit_live(slices, launched, logits)


def await_encoding_ahead(engine: Engine, current: InflightStep) -> None:
    """A waiting request whose media encode beside the decodes is admitted once that encoding has finished. Asked
    when the next step is scheduled, a step ahead of the device, that costs a step (W4 on the H200: the prefill
    began 9 ms after the encoding ended); so wait until the encoding ends, or the step in flight and then the
    configured pause do (the encoder alone on the device meanwhile), whichever first. Async scheduling only:
    scheduled after the tokens are read, a step is not ahead of the device."""
    config, runner = engine.config, engine.runner
    if not config.async_scheduling or config.deterministic or engine._followers is not None:
        return
    if any(r.media_sent_ahead for r in engine.scheduler.waiting) and runner.encoding_in_background():
        runner.encoding_finished_before(current.ready, config.encode_ahead_decode_pause_ms / 1e3)


def encode_ahead_first(engine: Engine, out: SchedulerOutput, current: InflightStep) -> Sequence:
    """Beside the decodes, the step's encoding ahead is launched before its decode rows, which wait as they would
    for an encoding already running (`await_encoding_ahead`): the encoder starts alone on the device. The media
    left for the step to encode (none then)."""
    if not out.media_ahead or not engine.runner.encodes_beside_decodes():
        return out.media_ahead
    engine.runner.encode_beside_decodes(out.media_ahead)
    engine._fail_a_failed_encoding_ahead(out)  # taken now: the step's run clears it
    await_encoding_ahead(engine, current)
    return ()


def schedules_ahead(engine: Engine, current: InflightStep) -> bool:
    """Requests wait to be admitted: schedule the next step now, its decode rows fed `current`'s tokens on the
    device, launch it, then commit `current` (waiting for its tokens, not for the launch) and the launched step;
    whether it did (`continuation.rows_scheduled_ahead` says when it may)."""
    config = engine.config
    if not schedules_async(engine) or not config.async_admissions or config.deterministic:
        return False
    found = rows_scheduled_ahead(current, engine.scheduler, engine.kv, engine.max_model_len)
    if found is None:
        return False
    rows, skip = found
    pending = {r.request_id: i for i, r in rows}
    try:  # the live rows decode in this step: the scheduler must not wait for their tokens to know it
        out = engine.scheduler.schedule(skip=skip, decoding=True, preempt=False)
    except Exception:  # a bug: commit the step in flight (its pending slots filled) before it surfaces
        engine._accept_tokens(current, set(pending))
        raise
    for request, reason in out.failed:
        engine._finish(request, FinishReason.ERROR, reason, keep_kv=False)
    slices = out.slices
    launched = samples_at_launch(slices, pending)  # before the tokens are read
    engine._stamp_first_scheduled(slices)
    lead = slices[: len(pending)]  # the decode rows, in the scheduler's order
    plan = engine.kv.take_plan()
    try:
        if out.preempted or {s.request.request_id for s in lead} != set(pending):
            raise RuntimeError("a step scheduled ahead must start with its decode rows and preempt no one")
        media_ahead = encode_ahead_first(engine, out, current)
        token_ids = current.device_tokens_of([pending[s.request.request_id] for s in lead])
        logits = engine.runner.execute(slices, engine.kv, plan, media_ahead,
                                       pending=[s.request.request_id for s in lead], token_ids=token_ids)
    except Exception as error:  # the launched step is lost, the one in flight is not: commit it, then fail
        lost_steps.fail_a_lost_step(engine, plan, [s.request for s in slices] + out.media_ahead_requests, error,
                                    (current, set(pending)))
        return True
    except BaseException:  # interrupted: the plan is settled all the same, then the interrupt goes on
        lost_steps.settle_after_an_interrupt(engine, plan)
        raise
    engine.kv.finish_plan(plan)
    engine.stats.async_steps += 1
    engine.stats.scheduled_ahead_steps += 1
    engine._accept_tokens(current, set(pending))
    engine._fail_a_failed_encoding_ahead(out)
    engine._commit_live(slices, launched, logits)
    return True


def schedules_async(engine: Engine) -> bool:
    """Whether steps may be launched on tokens no host has read: async scheduling, and under TP only with
    `tensor_parallel_async_scheduling` (the followers then take those tokens from rank 0)."""
    return engine.config.async_scheduling and (
        engine._followers is None or engine.config.tensor_parallel_async_scheduling)


def continuation_of(engine: Engine, current: InflightStep) -> Continuation:
    if not schedules_async(engine):
        return Continuation([])
    return plan_continuation(current, engine.scheduler, engine.kv, engine.runner, engine.max_model_len)
