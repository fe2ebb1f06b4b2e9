"""The engine behind the event loop: one owner thread steps the engine; coroutines talk to it by queue.

Owns the serving side of *liveness* (invariant 9): every submitted request's event stream ends with
exactly one terminal event, whatever happens: a client that goes away aborts its request (its pages are
released by the engine), a failing step fails only its requests, and shutdown aborts what is left.
Media decoding and preprocessing run in a worker pool, never on the event loop or the engine thread,
so running streams keep decoding while a cold image request is being prepared.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from ..engine.engine import Engine, RequestError
from ..engine.request import Branch, FinishReason, RequestOutput
from ..engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """Too many requests in flight: the client should retry later (HTTP 429)."""


class ShuttingDown(RuntimeError):
    """The server is stopping and accepts no new requests (HTTP 503)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EventObserver(Protocol):
    """Sees a request's events as they are read (the latency metrics' `RequestTracker`)."""

    def __call__(self, event: RequestOutput, now: float) -> None:
        """Each event, when it is read."""

    def abandoned(self, now: float) -> None:
        """The request ends unread (its client left): its terminal event will never be read."""


class GenerationEvents:
    """An accepted request's events, up to and including its terminal one. `aclose()` aborts the request unless its
    terminal event was read: also when it was never iterated (a class, not a generator, so that closing one that
    never started still aborts)."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream,
                 observe: EventObserver | None) -> None:
        self._engine = engine
        self.request_id = request_id
        self._stream = stream
        self._observe = observe
        self._done = False

    def __aiter__(self) -> GenerationEvents:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        event: RequestOutput = await self._stream.queue.get()
        if self._observe is not None:
            self._observe(event, time.perf_counter())
        self._done = event.finished
        return event

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)
            self._abandoned()

    def __del__(self) -> None:
        # Dropped unread and unclosed (a streaming response cancelled before its body started): abort, as an async
        # generator's finalizer would. `abort` only queues a command: safe wherever the collector runs this.
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)
            self._abandoned()

    def _abandoned(self) -> None:
        """Tell the observer (the metrics) that the request ends unread: its terminal event never reaches it."""
        if self._observe is not None:
            self._observe.abandoned(time.perf_counter())


@dataclass(frozen=True)
class _Add:
    request_ids: tuple[str, ...]  # whose events go to `stream`
    submit: Callable[[Engine], object]  # runs on the owner thread (add_request / add_decision)
    accepted: asyncio.Future
    stream: _Stream


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_in_flight: int = 256, preprocess_workers: int = 4) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # Requests admitted against `max_in_flight`: taken by `_submit` on the event loop before the owner thread
        # sees the request, given back by the owner thread (refused add, or terminal event). Counting streams
        # instead let a burst of submissions all pass the check before the first was registered.
        self._slots_taken = 0
        self._slots_lock = threading.Lock()
        self._stopping = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prism-engine", daemon=True)
        self._media_pool = ThreadPoolExecutor(preprocess_workers, thread_name_prefix="prism-media")

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Stop accepting and abort every request in flight (each gets its terminal event), without waiting. Safe
        from a signal handler; idempotent."""
        if not self._stopping:
            self._stopping = True
            self._commands.put(("stop",))
        self._wakeup.set()

    def shutdown(self, timeout: float = 30.0) -> bool:
        """Stop accepting, abort every request in flight (each gets its terminal event), stop the thread. False
        if the thread did not stop within `timeout` (a step still running: the engine is not to be torn down)."""
        self.begin_shutdown()
        stopped = self._stopped.wait(timeout)
        self._media_pool.shutdown(wait=False, cancel_futures=True)
        return stopped

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- the API for coroutines ------------------------------------------------------------------
    async def run_in_media_pool(self, fn: Callable, *args: Any) -> Any:
        """Run blocking media work (URL fetch, decode, preprocessing) off the loop and the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self._media_pool, fn, *args)

    async def generate(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        observe: EventObserver | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a prepared prompt; yield its events up to and including the terminal one (`start_generation`,
        consumed). Raises (before yielding) what `start_generation` raises. If the consumer stops early (client
        disconnect), the request is aborted."""
        events = await self.start_generation(request_id, prompt, params, observe)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def start_generation(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        observe: EventObserver | None = None,
    ) -> GenerationEvents:
        """Submit a prepared prompt; returns as soon as the engine accepted it (not at its first token), with its
        events to come. `observe(event, now)` sees each event first (latency metrics). Raises RequestError /
        SamplingParamsError for a request the engine refuses, Overloaded when too many are in flight,
        ShuttingDown while stopping."""
        stream = await self._submit((request_id,), lambda engine: engine.add_request(request_id, prompt, params))
        return GenerationEvents(self, request_id, stream, observe)

    async def decide(self, decision_id: str, branches: list[Branch]) -> dict[str, RequestOutput]:
        """Submit a decision; returns each branch's terminal event (which carries its readout)."""
        ids = tuple(b.request_id for b in branches)
        stream = await self._submit(ids, lambda engine: engine.add_decision(decision_id, branches),
                                    abort_also=(f"{decision_id}/material",))
        finals: dict[str, RequestOutput] = {}
        try:
            while len(finals) < len(ids):
                event: RequestOutput = await stream.queue.get()
                if event.finished:
                    finals[event.request_id] = event
            return finals
        finally:
            if len(finals) < len(ids):  # cancelled: stop the material and every branch still running
                for request_id in (f"{decision_id}/material", *ids):
                    self.abort(request_id)

    async def readout(
        self, request_id: str, prompt: Any, candidates: tuple[int, ...], temperature: float
    ) -> RequestOutput:
        """A readout request's terminal event (its probabilities over `candidates`)."""
        stream = await self._submit(
            (request_id,), lambda engine: engine.add_readout_request(request_id, prompt, candidates, temperature)
        )
        events = GenerationEvents(self, request_id, stream, None)
        try:
            async for event in events:
                if event.finished:
                    return event
        finally:
            await events.aclose()  # cancelled before its terminal event: aborted
        raise AssertionError("a request's events end with its terminal one")

    async def _submit(self, request_ids: tuple[str, ...], submit: Callable[[Engine], object],
                      abort_also: tuple[str, ...] = ()) -> _Stream:
        if self._stopping:
            raise ShuttingDown("the server is shutting down")
        if len(request_ids) > self.max_in_flight:  # never fits, even on an idle server: not a "retry later"
            raise RequestError(f"this needs {len(request_ids)} engine requests at once; the server runs at most "
                               f"{self.max_in_flight} in flight")
        with self._slots_lock:
            if self._slots_taken + len(request_ids) > self.max_in_flight:
                raise Overloaded(f"{self._slots_taken} requests in flight (limit {self.max_in_flight}); retry later")
            self._slots_taken += len(request_ids)
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        accepted = loop.create_future()
        self._commands.put(_Add(request_ids, submit, accepted, stream))
        self._wakeup.set()
        try:
            await accepted  # raises what the engine raised
        except asyncio.CancelledError:
            # Cancelled while the owner thread had not yet taken the add: it will still be added (and hold its
            # slots until its end). The aborts queue behind the add, so they land once it is in (no-op if refused).
            for request_id in (*request_ids, *abort_also):
                self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    # -- the owner thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if self._drain_commands():
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._wakeup.wait(0.05)
                    self._wakeup.clear()
            for request_id in list(self._streams):
                self.engine.abort(request_id)
            while self.engine.has_unfinished_requests():
                self._step()
        finally:
            self._stopped.set()

    def _drain_commands(self) -> bool:
        """Apply queued adds and aborts; True once a stop was requested."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif command[0] == "abort":
                self.engine.abort(command[1])
            elif command[0] == "stop":
                return True

    def _give_back_slots(self, n: int) -> None:
        with self._slots_lock:
            self._slots_taken -= n

    def _add(self, command: _Add) -> None:
        loop = command.stream.loop
        if self._stopping:
            self._give_back_slots(len(command.request_ids))
            loop.call_soon_threadsafe(_settle, command.accepted, ShuttingDown("the server is shutting down"))
            return
        try:
            command.submit(self.engine)
        except Exception as error:  # refused: the coroutine re-raises it as an HTTP error
            self._give_back_slots(len(command.request_ids))
            loop.call_soon_threadsafe(_settle, command.accepted, error)
            return
        for request_id in command.request_ids:
            self._streams[request_id] = command.stream
        loop.call_soon_threadsafe(_settle, command.accepted, None)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as error:  # a bug above the runner: fail every request rather than hang them
            log.exception("engine step failed; failing every request in flight")
            events = []
            for request_id in list(self._streams):
                self.engine.abort(request_id)
                events.append(RequestOutput(request_id, [], "", True, FinishReason.ERROR, f"engine failure: {error}"))
        self._hand_over(events)

    def _hand_over(self, events: list[RequestOutput]) -> None:
        """A step's events to their streams' event loops (a finished one gives its slot back).

        One hand-over per event loop per step, not one per event: each `call_soon_threadsafe` is a write to the loop's
        wake-up socket and a wake-up of the loop (32 per step with 32 streams). On the H200 this measured within the
        run-to-run spread of `bench_serve` (bench/NOTES.md, session 31), so it is kept for its fewer wake-ups only."""
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue
            if event.finished:
                del self._streams[event.request_id]
                self._give_back_slots(1)
            deliveries.setdefault(stream.loop, []).append((stream.queue, event))
        for loop, items in deliveries.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody reads its streams; the other loops still get theirs
                log.warning("an event loop closed under %d stream(s): their requests are aborted", len(items))
                for _, event in items:
                    if self._streams.pop(event.request_id, None) is not None:
                        self._give_back_slots(1)
                        self.engine.abort(event.request_id)


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """On the event loop: each event into its stream's queue, in the engine's order."""
    for stream_queue, event in items:
        stream_queue.put_nowait(event)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
