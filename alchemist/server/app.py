"""The FastAPI app: routes, the body-size guard, and the one table that turns exceptions into OpenAI errors.

    run_server(build(config, own_step_thread=False))   # what `alchemist serve` does: engine in the main thread
    app = create_app(build(config))                      # or an app that steps in a thread of its own (tests)

The system (model, engine, store, feedback log, trainer, stepping loop) is built by ``alchemist.runtime``; this
module only puts the HTTP front on it.

Every error, whoever raises it (pydantic, the service, the engine, the body guard), leaves through
``error_response`` as ``{"error": {"message", "type", "param", "code"}}`` with the status of ERROR_MAP.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from alchemist.activations.record import record_bytes_per_token
from alchemist.config import ServerConfig, is_loopback
from alchemist.engine import LLMEngine, QueueFullError
from alchemist.host_memory import allocator_in_use
from alchemist.model.lora import LoraAdapter
from alchemist.runtime import System
from alchemist.runtime.adapter_registry import AdapterRegistry
from alchemist.runtime.async_engine import AsyncEngine
from alchemist.runtime.trainers import served_path
from alchemist.server.adapters import AdapterService
from alchemist.server.auth import KeyStore
from alchemist.server.completions_registry import CompletionsRegistry
from alchemist.server.errors import (
    AdapterNotFoundError,
    AdapterNotTrainedError,
    AuthenticationError,
    BodyTooLargeError,
    FeedbackConflictError,
    FeedbackNotFoundError,
    ModelNotFoundError,
    NamedAdapterNotFoundError,
    PermissionDeniedError,
    RateLimitError,
    ResponseNotFoundError,
)
from alchemist.server.feedback import FeedbackService
from alchemist.server.limits import KeyLimits, LimitConfig
from alchemist.server.metrics import ServerMetrics
from alchemist.server.named_adapters import NamedAdapters
from alchemist.server.openapi import docs_router, install_openapi
from alchemist.server.protocol import ErrorInfo, ErrorResponse
from alchemist.server.quarantine import router as quarantine_router
from alchemist.server.routes import router
from alchemist.server.series import SeriesRecorder
from alchemist.server.service import OpenAIServing
from alchemist.server.web import mount_web

logger = logging.getLogger(__name__)

# Exception class -> (HTTP status, OpenAI error type, code). The most specific class in an exception's MRO wins,
# so the engine's and the tokenizer's ValueErrors (impossible requests) are 400s and anything unexpected a 500.
ERROR_MAP: dict[type[BaseException], tuple[int, str, str | None]] = {
    RequestValidationError: (400, "invalid_request_error", None),  # malformed JSON, wrong types, n > 1, ...
    BodyTooLargeError: (413, "invalid_request_error", "request_too_large"),
    ModelNotFoundError: (404, "invalid_request_error", "model_not_found"),
    QueueFullError: (429, "rate_limit_error", "server_overloaded"),  # the bounded waiting queue is full
    AuthenticationError: (401, "invalid_request_error", "invalid_api_key"),  # alchemist.server.auth
    PermissionDeniedError: (403, "invalid_request_error", "permission_denied"),
    RateLimitError: (429, "rate_limit_error", "rate_limit_exceeded"),  # a key's limits (alchemist.server.limits)
    ResponseNotFoundError: (404, "invalid_request_error", "response_not_found"),  # feedback on an unknown id
    AdapterNotFoundError: (404, "invalid_request_error", "adapter_not_found"),  # rollback to a version not kept
    NamedAdapterNotFoundError: (404, "invalid_request_error", "adapter_not_found"),  # unload of an unknown name
    AdapterNotTrainedError: (409, "invalid_request_error", "adapter_not_trained"),  # feedback on a named adapter's
    FeedbackNotFoundError: (404, "invalid_request_error", "feedback_not_found"),
    FeedbackConflictError: (409, "invalid_request_error", "feedback_id_conflict"),  # a reused client feedback_id
    ValueError: (400, "invalid_request_error", None),
    Exception: (500, "internal_server_error", None),
}


def error_response(exc: BaseException) -> Response:
    headers = getattr(exc, "headers", None)  # a 405's Allow, a 401's WWW-Authenticate, a 429's Retry-After
    if isinstance(exc, StarletteHTTPException):  # unknown route, wrong method
        status, kind, code, param, message = exc.status_code, "invalid_request_error", None, None, str(exc.detail)
    else:
        status, kind, code = next(ERROR_MAP[c] for c in type(exc).__mro__ if c in ERROR_MAP)
        message, param = _describe(exc)
        if status >= 500:
            logger.error("internal error", exc_info=exc)
            # The details (paths, values) stay in the server's log; the client learns only what kind of failure.
            message = f"internal error ({type(exc).__name__}); the server's log has the details"
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))
    # ASCII JSON: a message may quote input holding a lone surrogate, which UTF-8 cannot encode.
    content = json.dumps(body.model_dump(), ensure_ascii=True, separators=(",", ":"))
    return Response(content, status_code=status, media_type="application/json", headers=headers)


def _describe(exc: BaseException) -> tuple[str, str | None]:
    """(message, param) of an exception; pydantic's errors name the field by its location in the body."""
    if isinstance(exc, RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        return (f"{param}: {first.get('msg')}" if param else str(first.get("msg"))), param
    return str(exc), getattr(exc, "param", None)


class BodySizeLimitMiddleware:
    """Answers 413 to a body over ``max_body_bytes``: by its Content-Length, or by counting what arrives (chunked
    uploads have no length). The body is read here in full, then replayed to the app; later receive() calls (the
    disconnect watch of streams) pass through."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._reject(scope, receive, send, declared.isdigit())
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # a disconnect before the body ended
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await self._reject(scope, receive, send, True)
                return
            more = message.get("more_body", False)
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, too_large: bool) -> None:
        error = BodyTooLargeError(self.max_body_bytes) if too_large else ValueError("invalid Content-Length header")
        await error_response(error)(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed


def build_app(
    serving: OpenAIServing,
    async_engine: AsyncEngine,
    metrics: ServerMetrics,
    max_body_bytes: int,
    series: SeriesRecorder | None = None,
) -> FastAPI:
    """The app around ready parts; the engine thread and the dashboard's sampler run for the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        if series is not None:
            series.start()
        try:
            yield
        finally:
            if series is not None:
                series.stop()
            async_engine.shutdown()

    app = FastAPI(title="alchemist", lifespan=lifespan, docs_url=None, openapi_url=None)  # ours take keys
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.keys = KeyStore()  # none: open (create_app sets the server's)
    app.state.limits = serving.limits
    app.state.server_config = ServerConfig()
    app.state.series = series
    app.include_router(router)
    app.include_router(docs_router)
    app.include_router(quarantine_router)
    install_openapi(app)
    mount_web(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)

    async def handle(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    for exc_class in (RequestValidationError, StarletteHTTPException, *ERROR_MAP):
        app.add_exception_handler(exc_class, handle)
    return app


def create_app(system: System) -> FastAPI:
    """The HTTP front of a built ``System`` (``alchemist.runtime.build``): the OpenAI service, the feedback and
    adapter routes, keys, limits, metrics and the web pages. Its lifespan starts the stepping loop (in a thread of
    its own, unless the system was built for the caller to run ``run_steps``: see ``run_server``)."""
    engine, server_config, trainer = system.engine, system.config.server, system.trainer
    metrics = ServerMetrics(engine.stats)
    # The metrics observe the runtime's parts through callbacks attached here, after the build: they are made
    # around the built engine's stats, and Prometheus is the HTTP front's concern, not the runtime's.
    system.observe(metrics.observe, metrics.observe_step, metrics.observe_slice, metrics.observe_feedback)
    metrics.watch_feedback(system.feedback_log)
    metrics.show_objective(system.objective.tpot_s, system.objective.ttft_s)
    if trainer is not None:
        metrics.watch_training(trainer)
    async_engine = system.async_engine
    registry = CompletionsRegistry(server_config.max_completions_kept, server_config.completion_ttl_s)
    assert engine.config.max_model_len is not None
    anchors = trainer.anchors if trainer is not None else None
    serving = OpenAIServing(async_engine, engine.tokenizer, system.names, engine.config.max_model_len, registry,
                            anchors)  # fmt: skip
    series = SeriesRecorder(metrics, system.feedback_log, lambda: engine.adapter_version)
    app = build_app(serving, async_engine, metrics, server_config.max_body_bytes, series)
    app.state.keys = KeyStore(server_config.api_key, server_config.api_keys_file)
    serving.limits = app.state.limits = _key_limits(server_config, engine)
    app.state.server_config = server_config
    app.state.system = system
    app.state.async_engine = async_engine
    app.state.registry = registry  # for the feedback routes
    app.state.feedback_log = system.feedback_log
    app.state.feedback = FeedbackService(system.feedback_log, registry, engine.tokenizer, engine.config.max_model_len,
                                         system.trainers.named if system.trainers is not None else ())  # fmt: skip
    app.state.trainer = trainer
    app.state.named_adapters = serving.named = _named_adapters(system)
    app.state.adapters = AdapterService(engine, trainer, system.checkpoints, async_engine.wake, system.trainers,
                                        system.feedback_log, serving.named.registry)  # fmt: skip
    metrics.watch_adapters(serving.named.registry)
    return app


def _named_adapters(system: System) -> NamedAdapters:
    """The named adapters (--lora-modules read now: a bad one stops start-up with its ValueError)."""
    config, engine = system.config.server, system.engine
    trainers = system.trainers
    trained = trainers.named if trainers is not None else ()
    registry = AdapterRegistry(engine, config.max_loras, config.max_cpu_loras, reserved=system.names, trained=trained)
    for name, path in config.lora_module_paths:
        # one nothing trains here serves the version its training left serving, if it was trained before
        registry.register(name, path if name in trained else served_path(config.data_dir, name, path))
    assert engine.config.max_model_len is not None
    train = None
    if trainers is not None and trainers.trains_at_run_time:

        async def train(name: str, adapter: LoraAdapter) -> None:
            done = trainers.start(name, adapter)
            system.async_engine.wake()  # the stepping thread makes the trainer, in a slice
            await asyncio.wrap_future(done)

    return NamedAdapters(registry, system.names, engine.config.max_model_len, train)


def _key_limits(config: ServerConfig, engine: LLMEngine) -> KeyLimits:
    recorder = engine.recorder  # a record's size: its prompt's tokens x this (None: nothing is ever recorded)
    per_token = record_bytes_per_token(engine.model.config, recorder.dtype) if recorder is not None else 0
    return KeyLimits(LimitConfig.of(config), per_token)


def app_urls(server_config: ServerConfig) -> str:
    """The start-up line: where people open the app (an any-address bind is opened on this machine)."""
    host = "127.0.0.1" if server_config.host in ("", "0.0.0.0", "::") else server_config.host
    base = f"http://{f'[{host}]' if ':' in host else host}:{server_config.port}"
    return f"alchemist: chat at {base}/  dashboard at {base}/dashboard  OpenAI API at {base}/v1"


def run_server(system: System) -> None:
    """Serve ``system`` (built with ``own_step_thread`` False) until SIGINT/SIGTERM: the engine steps in this (main)
    thread, uvicorn runs in a second one.

    Why not the other way round: see the Note in ``alchemist.runtime.async_engine`` (torch ops from a thread other
    than the one that loaded the model ran at one-thread speed).
    """
    import uvicorn

    assert threading.current_thread() is threading.main_thread(), "run_server steps the engine in the main thread"
    assert not system.async_engine.own_step_thread, "run_server steps the engine itself: build(own_step_thread=False)"
    server_config = system.config.server
    app = create_app(system)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, workers=1, log_level="info")
    server = uvicorn.Server(config)  # outside the main thread it installs no signal handlers: ours do

    def stop(signum: int, frame: object) -> None:
        server.should_exit = True  # uvicorn drains, then the app's lifespan shuts the AsyncEngine down

    def serve_http() -> None:
        try:
            server.run()
        finally:  # however uvicorn ends (also a port already in use), the step loop must end too
            async_engine.shutdown()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    signal.signal(signal.SIGHUP, lambda signum, frame: app.state.keys.reload())
    _say_who_may_connect(server_config)
    async_engine = system.async_engine
    print(app_urls(server_config), flush=True)
    print(f"alchemist: {async_engine.engine.runner.describe_decode()}", flush=True)
    print(f"alchemist: memory allocator: {allocator_in_use()}", flush=True)
    http = threading.Thread(target=serve_http, name="uvicorn")
    http.start()
    try:
        async_engine.run_steps()
    finally:
        server.should_exit = True
        http.join()
        system.close()  # only now: the step loop (the trainer) may read the feedback log until it ends


def _say_who_may_connect(config: ServerConfig) -> None:
    if config.has_keys:
        logger.warning("API keys required (Authorization: Bearer ...) on %s:%d", config.host, config.port)
    elif is_loopback(config.host):
        logger.warning(
            "no API keys: serving %s:%d, loopback only (--api-key or --api-keys-file to serve other machines)",
            config.host,
            config.port,
        )
    else:
        logger.warning("no API keys on %s:%d (--allow-unauthenticated): anyone who reaches it may train and roll "
                       "back the model", config.host, config.port)  # fmt: skip
