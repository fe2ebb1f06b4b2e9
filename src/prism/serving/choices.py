"""A completion's choices: each its own engine request, submitted all or none (`start_choices`), their events merged
as they come (`_merge`: a choice whose events fail to be read fails the completion), and rendered as a stream
(`sse`) or one body (`json_or_error`). Once the 200 went out, a failure ends the stream with the internal error event
and [DONE]; a disconnected client's requests are aborted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.request import RequestOutput
from ..engine.sampling import SamplingParams
from .async_engine import GenerationEvents
from .internal_errors import internal_error_message, internal_error_response, report
from .protocol import ProtocolError
from .refusals import error_response
from .responses import RequestAborted, error_body
from .server_state import ServerState

log = logging.getLogger("prism.server")


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of n: its own engine request; a seeded request gets seed + i so choices differ."""
    seed = None if params.seed is None else (params.seed + index) % (2**64)
    return params.with_(n=1, seed=seed)


async def _start(state: ServerState, request_id: str, prompt, params: SamplingParams, tracker) -> GenerationEvents:
    """Submit one engine request; returns its events once the engine accepted it. Not at its first token: the
    choices of one completion are submitted together, and a stream's headers go out at once (the client's
    disconnect is then seen by `sse`), even when the choices are more than the engine runs at a time."""
    return await state.async_engine.start_generation(request_id, prompt, params, observe=tracker)


async def _merge(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Events of all choices as they come, tagged with their index. A choice whose events fail to be read (its pump
    raised) fails the merge with that exception, rather than leaving it waiting for events that will not come."""
    if len(streams) == 1:
        try:
            async for event in streams[0]:
                yield 0, event
        finally:
            await streams[0].aclose()  # left early (the client went away): its request is aborted
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for event in stream:
                await queue.put((index, event))
        except Exception as error:  # noqa: BLE001 - raised by the merge below
            await queue.put((index, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(streams):
            index, event = await queue.get()
            if isinstance(event, Exception):
                raise event
            done += event.finished
            yield index, event
    finally:
        for task in tasks:
            task.cancel()
        # Abort first: under Starlette's (anyio's) cancellation every await here is cancelled again, so nothing
        # after the first await would run. GenerationEvents.aclose does not suspend.
        for stream in streams:
            await stream.aclose()
        await asyncio.gather(*tasks, return_exceptions=True)


async def start_choices(state: ServerState, completion_id: str, choices: list, arrival: float,
                        per_prompt: int | None = None) -> list[GenerationEvents] | Response:
    """Submit each (prompt, params) choice as its own engine request (`completion_id-i`); the seeds of a prompt's
    choices are its seed + 0, 1, ... (`per_prompt`: choices per prompt; default all one prompt's). All or none: a
    refusal closes the ones already submitted and is returned as the error response."""
    if len(choices) > state.async_engine.max_in_flight:  # never fits: not a 429 "retry later"
        return error_response(state, ProtocolError(
            f"the request asks for {len(choices)} choices, more than the server runs at once "
            f"({state.async_engine.max_in_flight})", param="n"), completion_id)
    per_prompt = per_prompt or len(choices)
    streams = []
    try:
        for i, (prompt, params) in enumerate(choices):
            # a prompt's tokens are counted once, with its first choice (as usage counts them)
            tracker = state.metrics.tracker(arrival, count_prompt=i % per_prompt == 0)
            streams.append(await _start(state, f"{completion_id}-{i}", prompt, _choice_params(params, i % per_prompt),
                                        tracker))
    except Exception as error:  # noqa: BLE001
        for stream in streams:
            await stream.aclose()
        return error_response(state, error, completion_id)
    return streams


def event_stream(body) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def sse(out, streams: list):
    """SSE bytes of one completion: `out` (ChatCompletionStream or CompletionRenderer) renders the events. A failure
    (the engine failed a choice, or rendering raised) ends it with the internal error event, then [DONE]."""
    merged = _merge(streams)
    try:
        yield out.start()
        async for index, event in merged:
            data = out.on_output(index, event)
            if data:
                yield data
        yield out.finish()
    except RequestAborted as error:  # shutting down: its own 503, not a failure
        log.info("completion %s aborted: the server is shutting down", out.id)
        yield out.error(error.status, str(error))
    except Exception as error:  # noqa: BLE001 - the 200 went out: the stream's end is the only answer left
        yield out.error(500, internal_error_message(report(error, out.id)))
    finally:
        await merged.aclose()  # a disconnected client lands here: its requests are aborted


async def collect(streams: list) -> list[list[RequestOutput]]:
    """Every choice's events, in order."""
    events: list[list[RequestOutput]] = [[] for _ in streams]
    merged = _merge(streams)
    try:
        async for index, event in merged:
            events[index].append(event)
    finally:
        await merged.aclose()  # cancelled (the client left): its requests are aborted
    return events


def json_or_error(build, completion_id: str) -> JSONResponse:
    """The body `build()` makes, or the internal error of a choice the engine failed or of a failed rendering (even
    a ValueError: the request was accepted, so what fails now is the server)."""
    try:
        response = build()
    except RequestAborted as error:  # shutting down: its own 503, not a failure
        log.info("completion %s aborted: the server is shutting down", completion_id)
        return JSONResponse(error_body(error.status, str(error)), status_code=error.status)
    except Exception as error:  # noqa: BLE001
        return internal_error_response(error, completion_id)
    # OpenAI's nulls kept ("logprobs": null when none were asked, a token's "bytes": null): what clients parse.
    return JSONResponse(response.model_dump(mode="json"))
