"""The FastAPI application: OpenAI-compatible chat and text completions, models, metrics and decisions over the
async engine.

Owns *hostile input -> 4xx, nothing lost* at the endpoints: every request body is size-checked (`refusals.read_body`),
parsed and validated before anything is allocated; media are resolved and preprocessed in the worker pool with their
own limits; refusals carry an OpenAI-style error body (`refusals.py`), and the server's own failures a 500 that names
only a request id (`internal_errors.py`); a completion's choices are submitted all or none and rendered by
`choices.py`; a client that disconnects aborts its engine requests (their pages are released; `cancellation.py`);
shutdown, and before it an exit signal (`exit_signals.py`), aborts whatever is still running.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..decision.plan import DecisionFailed, plan_decision
from ..engine.chat import InputError
from ..engine.detokenize import incomplete_tail
from ..engine.engine import Engine
from .body_deadline import BodyDeadline
from .cancellation import ClientGone, until_disconnected
from .choices import collect, event_stream, json_or_error, sse, start_choices
from .completions import CompletionRenderer, CompletionRequest, parse_completion_request
from .decide_protocol import DecideRequest, decide_response, parse_decide_request
from .decide_runner import run_plan
from .exit_signals import abort_requests_on_exit_signals
from .internal_errors import InternalErrors
from .protocol import (
    ChatCompletionRequest,
    ProtocolError,
    describe_validation_errors,
    parse_chat_request,
)
from .refusals import error_response, model_not_found, read_body
from .responses import ModelCard, ModelList, RequestAborted, error_body
from .server_state import ServerState, build_engine
from .settings import ServerSettings
from .stream import ChatCompletionStream, build_response, new_completion_id

log = logging.getLogger("prism.server")


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
            error = model_not_found(model_id, state)
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
            return error_response(state, error, "POST /v1/chat/completions")
        completion_id = new_completion_id()
        submitted = await start_choices(state, completion_id, [(prompt, params)] * chat.num_choices, arrival)
        if isinstance(submitted, Response):
            return submitted
        token_bytes = state.token_bytes if chat.logprobs else None
        if chat.stream:
            out = ChatCompletionStream(chat.model, n=len(submitted), include_usage=chat.include_usage,
                                       token_bytes=token_bytes, completion_id=completion_id, created=int(time.time()))
            return event_stream(sse(out, submitted))
        try:
            events = await until_disconnected(request, collect(submitted))
        except ClientGone:
            return Response(status_code=499)
        return json_or_error(lambda: build_response(completion_id, int(time.time()), chat.model, events, token_bytes),
                              completion_id)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        """The legacy text-completions API: raw prompts, no chat template (see serving/completions.py)."""
        state: ServerState = request.app.state.prism
        arrival = time.perf_counter()
        try:
            inputs = state.engine.inputs
            completion = parse_completion_request(await read_body(request, state), state.engine.max_prompt_tokens,
                                                  inputs.max_prompt_chars)
            if completion.model != state.settings.served_model_name:
                raise model_not_found(completion.model, state)
            prompts = await state.async_engine.run_in_media_pool(_completion_prompts, state, completion)
            params = [completion.params_for(len(p.token_ids), state.engine.max_model_len) for p in prompts]
            ends = await state.async_engine.run_in_media_pool(_prompt_ends, state, prompts, completion.prompts,
                                                              bool(completion.echo))
        except Exception as error:  # noqa: BLE001 - every refusal becomes an OpenAI error body
            return error_response(state, error, "POST /v1/completions")
        n = completion.num_choices
        renderer = CompletionRenderer(
            completion.model, [echo for echo, _ in ends for _ in range(n)], n, include_usage=completion.include_usage,
            token_bytes=state.token_bytes if completion.logprobs is not None else None,
            skipped_tokens=state.token_bytes.special, prompt_tails=[tail for _, tail in ends for _ in range(n)])
        submitted = await start_choices(
            state, renderer.id, [(prompt, p) for prompt, p in zip(prompts, params, strict=True) for _ in range(n)],
            arrival, per_prompt=n)
        if isinstance(submitted, Response):
            return submitted
        if completion.stream:
            return event_stream(sse(renderer, submitted))
        try:
            events = await until_disconnected(request, collect(submitted))
        except ClientGone:
            return Response(status_code=499)
        return json_or_error(lambda: renderer.response(events), renderer.id)

    @app.post("/v1/decide", response_model=None)
    async def decide(request: Request) -> Response:
        """One material, several questions, answers as probabilities (see serving/decide_protocol.py)."""
        state: ServerState = request.app.state.prism
        arrival = time.perf_counter()
        try:
            body = await read_body(request, state)
            decide_request, questions = parse_decide_request(body)
            if decide_request.model != state.settings.served_model_name:
                raise model_not_found(decide_request.model, state)
            _require_chat_template(state, "/v1/decide")
            material = await state.async_engine.run_in_media_pool(
                state.resolver.resolve_messages, decide_request.material, "material"
            )
            decision_id = f"decide-{uuid.uuid4().hex}"
            thinking = decide_request.thinking.to_config() if decide_request.thinking is not None else None
            plan = plan_decision(decision_id, material, questions, state.engine.inputs, thinking,
                                 state.engine.max_prompt_tokens)
            answers = await until_disconnected(request, run_plan(state, plan))
        except ClientGone:
            state.metrics.decides.labels(outcome="abandoned").inc()
            return Response(status_code=499)
        except DecisionFailed as error:  # the engine failed a question (the log says which and why) or, shutting
            state.metrics.decides.labels(outcome="failed").inc()  # down, aborted it
            return error_response(state, RequestAborted() if error.aborted else error, decision_id)
        except Exception as error:  # noqa: BLE001 - every refusal becomes an OpenAI-style error body
            return error_response(state, error, "POST /v1/decide")
        state.metrics.decided(arrival, time.perf_counter(), len(answers))
        response = decide_response(decision_id, int(time.time()), decide_request.model, answers)
        return JSONResponse(response.model_dump(mode="json", exclude_none=True))

    return app


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


async def _parse(request: Request, state: ServerState) -> ChatCompletionRequest:
    chat = parse_chat_request(await read_body(request, state))
    if chat.model != state.settings.served_model_name:
        raise model_not_found(chat.model, state)
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


def _prompt_ends(state: ServerState, prompts: list, raws: list, echo: bool) -> list[tuple[str, bytes]]:
    """Each prompt's echo ("" without `echo`) and the bytes of the incomplete character it ends with (b"" if none),
    which the completion's text starts with (`engine.detokenize`). The echo is the string as sent, or the token ids
    decoded (special tokens kept) but that character (the decode ends with it as one U+FFFD)."""
    ends = []
    for prompt, raw in zip(prompts, raws, strict=True):
        tail = incomplete_tail(state.token_bytes, prompt.token_ids)
        if not echo:
            text = ""
        elif isinstance(raw, str):
            text = raw  # whole characters: its tokens end with none incomplete
        else:
            text = state.engine.inputs.decode(prompt.token_ids, skip_special_tokens=False)
            text = text[:-1] if tail else text
        ends.append((text, tail))
    return ends
