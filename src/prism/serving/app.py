"""The FastAPI application: OpenAI-compatible chat and text completions, models, metrics and decisions over the
async engine.

Owns *hostile input -> 4xx, nothing lost*: every request body is size-checked, parsed and validated
before anything is allocated; media are resolved and preprocessed in the worker pool with their own
limits; refusals carry an OpenAI-style error body, and the server's own failures a 500 that names only a request id
(`internal_errors.py`); a client that disconnects mid-stream aborts its engine requests (their pages are released);
shutdown aborts whatever is still running.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..decision.plan import DecisionFailed, Generations, Outcome, Readouts, advance, plan_decision
from ..engine.chat import InputError
from ..engine.config import EngineConfig
from ..engine.engine import Engine, EngineStopped
from ..engine.request import RequestOutput
from ..engine.sampling import SamplingParams
from ..media.errors import ImageTooLargeError
from .async_engine import AsyncEngine, GenerationEvents, Overloaded, ShuttingDown
from .body_deadline import BodyDeadline, BodyReadTimeout
from .completions import CompletionRenderer, CompletionRequest, parse_completion_request
from .decide_protocol import DecideRequest, decide_response, parse_decide_request
from .internal_errors import InternalErrors, internal_error_message, internal_error_response, report
from .media_urls import MediaResolver
from .metrics import ServingMetrics
from .protocol import (
    ChatCompletionRequest,
    ProtocolError,
    describe_validation_errors,
    parse_chat_request,
)
from .responses import ModelCard, ModelList, RequestAborted, error_body, error_from_exception
from .settings import ServerSettings
from .stream import ChatCompletionStream, build_response, byte_level_token_bytes, new_completion_id

log = logging.getLogger("prism.server")


class ServerState:
    """What the endpoints share: settings, the engine behind its owner thread, metrics, media resolver."""

    def __init__(self, settings: ServerSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = engine
        self.async_engine = AsyncEngine(
            engine, max_in_flight=settings.max_waiting_requests, preprocess_workers=settings.preprocess_workers
        )
        self.metrics = ServingMetrics(engine)
        self.resolver = MediaResolver(settings)
        self.token_bytes = byte_level_token_bytes(engine.inputs.tokenizer)
        # The special tokens a completion's text leaves out (its detokenizer skips them): `text_offset` counts none.
        self.special_token_ids = frozenset(
            i for i, token in engine.inputs.tokenizer.get_added_tokens_decoder().items() if token.special)
        self.created = int(time.time())


def build_engine(settings: ServerSettings) -> Engine:
    config = EngineConfig.from_json(settings.engine_config_path) if settings.engine_config_path else EngineConfig()
    if settings.model_dir is None:
        from ..testing.checkpoints import ensure_tiny_checkpoint

        model_dir = ensure_tiny_checkpoint()
        log.warning("PRISM_MODEL is not set: serving the embedded tiny random-weight checkpoint at %s "
                    "(its answers are noise; set PRISM_MODEL to a Qwen3-VL directory)", model_dir)
    else:
        model_dir = Path(settings.model_dir)
    return Engine(model_dir, config)


def create_app(settings: ServerSettings | None = None, engine: Engine | None = None) -> FastAPI:
    """The app; the engine is built at startup (from `settings`) unless one is given."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        resolved = settings or ServerSettings.from_env()
        state = ServerState(resolved, engine or await asyncio.to_thread(build_engine, resolved))
        state.async_engine.start()
        app.state.prism = state
        restore_signals = abort_requests_on_exit_signals(state.async_engine)
        log.info("serving %s", resolved.served_model_name)
        if state.engine.inputs.chat_template is None:
            log.warning("the model %s (%s) has %s: /v1/chat/completions and /v1/decide (chat messages) will be refused "
                        "with a 400; /v1/completions (raw prompts) works", resolved.served_model_name,
                        state.engine.model_dir, NO_CHAT_TEMPLATE)
        try:
            yield
        finally:
            restore_signals()
            stopped = await asyncio.to_thread(state.async_engine.shutdown)
            if engine is None and stopped:  # built here, so stopped here: tensor-parallel followers leave cleanly
                await asyncio.to_thread(state.engine.shutdown)
            elif engine is None:
                log.error("the engine thread did not stop; its tensor-parallel ranks are left to the exit handler")

    app = FastAPI(title="Prism", version="0.1.0", lifespan=lifespan)
    # The last added is the outermost: every failure below, the deadline's reading of its setting included, is a 500
    # of `InternalErrors`.
    app.add_middleware(BodyDeadline, timeout_s=lambda: app.state.prism.settings.body_read_timeout_s)
    app.add_middleware(InternalErrors)
    _document_raw_bodies(app)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(exc.errors())
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing's own refusals (an unknown path: 404, a wrong method: 405) in OpenAI's error body too."""
        return JSONResponse(error_body(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"),
                            status_code=exc.status_code, headers=exc.headers)

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 "ok" while the engine serves; 503 once it cannot (its tensor-parallel ranks stopped), so that a
        supervisor restarts the server."""
        state: ServerState = request.app.state.prism
        if state.engine.is_stopped:
            return PlainTextResponse("the engine stopped: restart the server", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/v1/models", response_model=ModelList)
    async def models(request: Request) -> ModelList:
        return ModelList(data=[_model_card(request.app.state.prism)])

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str, request: Request) -> Response:
        state: ServerState = request.app.state.prism
        if model_id != state.settings.served_model_name:  # a lookup, not a refused request: not in the metrics
            error = _model_not_found(model_id, state)
            return JSONResponse(error_body(error.status, str(error), error.param, error.code),
                                status_code=error.status)
        return JSONResponse(_model_card(state).model_dump(mode="json"))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state: ServerState = request.app.state.prism
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        state: ServerState = request.app.state.prism
        arrival = time.perf_counter()
        try:
            chat = await _parse(request, state)
            params = chat.to_sampling_params(default_max_tokens=state.engine.max_model_len)
            messages = await state.async_engine.run_in_media_pool(state.resolver.resolve_messages, chat.messages)
            # The image uuids are bound when the engine accepts the prompt: a refused request names nothing.
            prompt = await state.async_engine.run_in_media_pool(
                functools.partial(state.engine.inputs.prepare_chat, bind_names=False), messages)
            _check_context(chat, len(prompt.token_ids), state.engine.max_model_len)
        except Exception as error:  # noqa: BLE001 - every refusal becomes an OpenAI error body
            return _error_response(state, error, "POST /v1/chat/completions")
        completion_id = new_completion_id()
        submitted = await _start_choices(state, completion_id, [(prompt, params)] * chat.num_choices, arrival)
        if isinstance(submitted, Response):
            return submitted
        token_bytes = state.token_bytes if chat.logprobs else None
        if chat.stream:
            out = ChatCompletionStream(chat.model, n=len(submitted), include_usage=chat.include_usage,
                                       token_bytes=token_bytes, completion_id=completion_id, created=int(time.time()))
            return _event_stream(_sse(out, submitted))
        try:
            events = await _until_disconnected(request, _collect(submitted))
        except ClientGone:
            return Response(status_code=499)
        return _json_or_error(lambda: build_response(completion_id, int(time.time()), chat.model, events, token_bytes),
                              completion_id)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        """The legacy text-completions API: raw prompts, no chat template (see serving/completions.py)."""
        state: ServerState = request.app.state.prism
        arrival = time.perf_counter()
        try:
            inputs = state.engine.inputs
            completion = parse_completion_request(await _read_body(request, state), state.engine.max_prompt_tokens,
                                                  inputs.max_prompt_chars)
            if completion.model != state.settings.served_model_name:
                raise _model_not_found(completion.model, state)
            prompts = await state.async_engine.run_in_media_pool(_completion_prompts, state, completion)
            params = [completion.params_for(len(p.token_ids), state.engine.max_model_len) for p in prompts]
            echoes = (await state.async_engine.run_in_media_pool(_echoes, state, prompts, completion.prompts)
                      if completion.echo else [""] * len(prompts))
        except Exception as error:  # noqa: BLE001 - every refusal becomes an OpenAI error body
            return _error_response(state, error, "POST /v1/completions")
        n = completion.num_choices
        renderer = CompletionRenderer(
            completion.model, [echo for echo in echoes for _ in range(n)], n, include_usage=completion.include_usage,
            token_bytes=state.token_bytes if completion.logprobs is not None else None,
            skipped_tokens=state.special_token_ids)
        submitted = await _start_choices(
            state, renderer.id, [(prompt, p) for prompt, p in zip(prompts, params, strict=True) for _ in range(n)],
            arrival, per_prompt=n)
        if isinstance(submitted, Response):
            return submitted
        if completion.stream:
            return _event_stream(_sse(renderer, submitted))
        try:
            events = await _until_disconnected(request, _collect(submitted))
        except ClientGone:
            return Response(status_code=499)
        return _json_or_error(lambda: renderer.response(events), renderer.id)

    @app.post("/v1/decide", response_model=None)
    async def decide(request: Request) -> Response:
        """One material, several questions, answers as probabilities (see serving/decide_protocol.py)."""
        state: ServerState = request.app.state.prism
        arrival = time.perf_counter()
        try:
            body = await _read_body(request, state)
            decide_request, questions = parse_decide_request(body)
            if decide_request.model != state.settings.served_model_name:
                raise _model_not_found(decide_request.model, state)
            _require_chat_template(state, "/v1/decide")
            material = await state.async_engine.run_in_media_pool(
                state.resolver.resolve_messages, decide_request.material, "material"
            )
            decision_id = f"decide-{uuid.uuid4().hex}"
            thinking = decide_request.thinking.to_config() if decide_request.thinking is not None else None
            plan = plan_decision(decision_id, material, questions, state.engine.inputs, thinking,
                                 state.engine.max_prompt_tokens)
            answers = await _until_disconnected(request, _run_plan(state, plan))
        except ClientGone:
            state.metrics.decides.labels(outcome="abandoned").inc()
            return Response(status_code=499)
        except DecisionFailed as error:  # the engine failed a question (the log says which and why) or, shutting
            state.metrics.decides.labels(outcome="failed").inc()  # down, aborted it
            return _error_response(state, RequestAborted() if error.aborted else error, decision_id)
        except Exception as error:  # noqa: BLE001 - every refusal becomes an OpenAI-style error body
            return _error_response(state, error, "POST /v1/decide")
        state.metrics.decided(arrival, time.perf_counter(), len(answers))
        response = decide_response(decision_id, int(time.time()), decide_request.model, answers)
        return JSONResponse(response.model_dump(mode="json", exclude_none=True))

    return app


def abort_requests_on_exit_signals(async_engine: AsyncEngine) -> Callable[[], None]:
    """On SIGINT / SIGTERM, stop accepting and abort every request before the server's own handler runs (uvicorn's
    graceful shutdown waits for open responses to end, and a stream may run for the whole context: a SIGTERM with
    four streams in flight had not ended after 295 s). Each stream then ends with an error event and [DONE], new
    requests get a 503, and the shutdown goes on. Installed over the handlers in place (uvicorn's, which it sets
    before the app starts) when the server runs in the main thread; returns what puts them back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # (a server in a thread installs no handlers either)
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)
        if not callable(previous):
            continue

        def handler(signum, frame, previous=previous) -> None:
            async_engine.begin_shutdown()
            previous(signum, frame)

        signal.signal(sig, handler)
        installed.append((sig, previous, handler))

    def restore() -> None:
        for sig, previous, handler in installed:
            if signal.getsignal(sig) is handler:  # (uvicorn may have put its own back already)
                signal.signal(sig, previous)

    return restore


async def _run_plan(state: ServerState, plan) -> list:
    """A decision plan to its answers. Each plan step prepares prompts (template, image preprocessing): it runs off
    the event loop."""
    step, value = await state.async_engine.run_in_media_pool(advance, plan, None)
    while step == "work":
        outcomes = await _run_work(state, value)
        step, value = await state.async_engine.run_in_media_pool(advance, plan, outcomes)
    return value


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before its answer: the work was cancelled."""


DISCONNECT_POLL_S = 0.25


async def _until_disconnected(request: Request, work):
    """Await `work` (a coroutine), cancelling it if the client disconnects first (polled every DISCONNECT_POLL_S):
    the engine requests it was waiting on are aborted by their own cancellation paths, so a client that gave up
    does not keep its questions or choices computing to the end."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its cleanup (aborts) done before we return


async def _run_work(state: ServerState, work: Readouts | Generations) -> dict[str, Outcome]:
    """One batch of a decision plan through the async engine."""
    engine = state.async_engine
    if isinstance(work, Readouts) and work.decision_id is not None:
        finals = await engine.decide(work.decision_id, work.branches)
    elif isinstance(work, Readouts):
        events = await _all_or_none(
            [engine.readout(b.request_id, b.prompt, b.candidates, b.temperature) for b in work.branches]
        )
        finals = {b.request_id: e for b, e in zip(work.branches, events, strict=True)}
    else:
        async def generate(request_id, prompt, params) -> tuple[RequestOutput, list[int]]:
            tokens: list[int] = []
            async for event in engine.generate(request_id, prompt, params):
                tokens += event.new_token_ids
            return event, tokens

        results = await _all_or_none([generate(*r) for r in work.requests])
        return {
            rid: Outcome(None, tokens, e.prompt_tokens, e.cached_tokens, e.error)
            for (rid, _, _), (e, tokens) in zip(work.requests, results, strict=True)
        }
    return {rid: Outcome(e.readout, None, e.prompt_tokens, e.cached_tokens, e.error) for rid, e in finals.items()}


async def _all_or_none(coros: list) -> list:
    """asyncio.gather, but one failing cancels the others (their requests are aborted), rather than leaving them
    running for a client that already got its error."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# -- helpers ---------------------------------------------------------------------------------------
def _document_raw_bodies(app: FastAPI) -> None:
    """The POST endpoints read their raw body (to size-check it first), so FastAPI cannot infer their
    schemas: publish the request models' JSON schemas as the request bodies in /openapi.json."""
    from fastapi.openapi.utils import get_openapi

    bodies = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
              "/v1/decide": DecideRequest}

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                spec["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
                }
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi


async def _read_body(request: Request, state: ServerState) -> bytes:
    """The raw body, refused (413) as soon as it is known to exceed the limit, or (408) once it is late
    (`BodyReadTimeout`, raised by the reads: body_deadline.py)."""
    limit = state.settings.max_request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge(f"the request body has {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise _TooLarge(f"the request body exceeds {limit} bytes")
    return bytes(body)


async def _parse(request: Request, state: ServerState) -> ChatCompletionRequest:
    chat = parse_chat_request(await _read_body(request, state))
    if chat.model != state.settings.served_model_name:
        raise _model_not_found(chat.model, state)
    _require_chat_template(state, "/v1/chat/completions")
    return chat


NO_CHAT_TEMPLATE = "no chat template (no chat_template.jinja, chat_template.json or tokenizer_config.json chat_template)"


def _require_chat_template(state: ServerState, endpoint: str) -> None:
    """A 400 for chat messages to a model without a chat template (nothing could render them), before any media is
    resolved; the server warned at start."""
    if state.engine.inputs.chat_template is None:
        raise ProtocolError(f"the model {state.settings.served_model_name!r} has {NO_CHAT_TEMPLATE}, so {endpoint} "
                            "(chat messages) is refused: send a raw prompt to /v1/completions")


def _check_context(chat: ChatCompletionRequest, prompt_tokens: int, max_model_len: int) -> None:
    """An explicit max_tokens (or max_completion_tokens) that the context cannot hold is a 400, as vLLM and OpenAI
    answer it, rather than an answer cut short; without one, a completion may run to the end of the context."""
    asked = chat.max_completion_tokens or chat.max_tokens
    if asked is not None and prompt_tokens + asked > max_model_len:
        name = "max_completion_tokens" if chat.max_completion_tokens else "max_tokens"
        raise ProtocolError(f"this model's context is {max_model_len} tokens; the prompt has {prompt_tokens} and "
                            f"{name} asks for {asked} more", param=name)


class _TooLarge(ValueError):
    status = 413
    param = None


class _NotFound(ValueError):
    status = 404
    param = "model"
    code = "model_not_found"


def _model_not_found(model: str, state: ServerState) -> _NotFound:
    return _NotFound(f"the model {model!r} does not exist; this server serves {state.settings.served_model_name!r}")


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.settings.served_model_name, created=state.created,
                     max_model_len=state.engine.max_model_len)


def _completion_prompts(state: ServerState, completion: CompletionRequest) -> list:
    """Each prompt of a completions request prepared (tokenized; token ids checked), off the event loop. A refused
    one is named (`param` "prompt", its index in the message when there are several)."""
    inputs, prompts = state.engine.inputs, completion.prompts
    prepared = []
    for i, p in enumerate(prompts):
        try:
            prepared.append(inputs.prepare_prompt(p) if isinstance(p, str) else inputs.prepare_token_ids(p))
        except InputError as error:
            raise ProtocolError(f"prompt {i}: {error}" if len(prompts) > 1 else str(error), param="prompt") from error
    return prepared


def _echoes(state: ServerState, prompts: list, raws: list) -> list[str]:
    """The text each echoed prompt shows: the string as sent, or its token ids decoded (special tokens kept)."""
    return [raw if isinstance(raw, str) else state.engine.inputs.decode(prompt.token_ids, skip_special_tokens=False)
            for prompt, raw in zip(prompts, raws, strict=True)]


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of n: its own engine request; a seeded request gets seed + i so choices differ."""
    seed = None if params.seed is None else (params.seed + index) % (2**64)
    return params.with_(n=1, seed=seed)


async def _start(state: ServerState, request_id: str, prompt, params: SamplingParams, tracker) -> GenerationEvents:
    """Submit one engine request; returns its events once the engine accepted it. Not at its first token: the
    choices of one completion are submitted together, and a stream's headers go out at once (the client's
    disconnect is then seen by `_sse`), even when the choices are more than the engine runs at a time."""
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


async def _start_choices(state: ServerState, completion_id: str, choices: list, arrival: float,
                         per_prompt: int | None = None) -> list[GenerationEvents] | Response:
    """Submit each (prompt, params) choice as its own engine request (`completion_id-i`); the seeds of a prompt's
    choices are its seed + 0, 1, ... (`per_prompt`: choices per prompt; default all one prompt's). All or none: a
    refusal closes the ones already submitted and is returned as the error response."""
    if len(choices) > state.async_engine.max_in_flight:  # never fits: not a 429 "retry later"
        return _error_response(state, ProtocolError(
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
        return _error_response(state, error, completion_id)
    return streams


def _event_stream(body) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse(out, streams: list):
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


async def _collect(streams: list) -> list[list[RequestOutput]]:
    """Every choice's events, in order."""
    events: list[list[RequestOutput]] = [[] for _ in streams]
    merged = _merge(streams)
    try:
        async for index, event in merged:
            events[index].append(event)
    finally:
        await merged.aclose()  # cancelled (the client left): its requests are aborted
    return events


def _json_or_error(build, completion_id: str) -> JSONResponse:
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


def _error_response(state: ServerState, error: Exception, where: str) -> Response:
    """A refusal's own error body, or for anything else (a 500) the internal error naming a request id, the failure
    logged under it (`where`: the endpoint or completion)."""
    if isinstance(error, ClientDisconnect):  # it left while sending its body: no one to answer, nothing failed
        return Response(status_code=499)
    if isinstance(error, Overloaded):
        status, body = 429, error_body(429, str(error))
    elif isinstance(error, (ShuttingDown, EngineStopped, RequestAborted)):
        status, body = 503, error_body(503, str(error))
    elif isinstance(error, ImageTooLargeError):  # includes decompression bombs
        status, body = 413, error_body(413, str(error))
    else:
        status, body = error_from_exception(error)
        if status >= 500:  # not a refusal: the server failed
            state.metrics.rejected.labels(status="500").inc()
            return internal_error_response(error, where)
    state.metrics.rejected.labels(status=str(status)).inc()
    # 429: retry later (the requests in flight finish in time); a 408's headers close the connection
    headers = {"Retry-After": "1"} if status == 429 else error.headers if isinstance(error, BodyReadTimeout) else None
    return JSONResponse(body, status_code=status, headers=headers)

