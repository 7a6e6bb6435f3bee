"""The front: one HTTP server before the replicas, with the API of one (``alchemist serve --replicas N``).

    replicas = ReplicaSet([Handle(i, actor) for i, actor in enumerate(actors)])
    app = create_front(replicas, config.server)        # uvicorn serves it on the server's port

It serves nothing itself but ``GET /v1/replicas`` (admin) and its own ``/metrics``; every other request passes
through to a replica, as it came (keys included: each replica checks them as one server does), and its answer comes
back as the replica gave it, streamed chunk by chunk. A key's limits (``alchemist.server.limits``: its request and
feedback rates, its streams) are taken here, over all replicas together, before a request passes: a replica takes
them too, over what reaches it, which never refuses what the front let through. Which replica a request goes to,
and which replicas train together, is the ``ReplicaSet``'s (``alchemist.scale.replica_set``): a completion to its
conversation's replica (the first ``AFFINITY_CHARS`` characters of a completion's prompt name it), feedback to the
replica that served the response, everything else to the first replica ready.

A replica the front cannot reach (its process died, or Ray restarts it) is marked ``dead`` and gets no requests
until ``info`` says it is ``ready`` again; a stream cut by its death ends with an error event in the OpenAI
envelope, not a hang; a request that had not reached it goes to another.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from alchemist.config import ServerConfig
from alchemist.scale.replica_set import Handle, NoReplicaError, ReplicaSet
from alchemist.server.app import error_response
from alchemist.server.auth import Caller, KeyStore, admin, bearer, metrics_reader, user
from alchemist.server.errors import AuthenticationError, PermissionDeniedError, RateLimitError
from alchemist.server.limits import KeyLimits, LimitConfig

AFFINITY_CHARS = 512  # of a completion's prompt: what names its conversation
ROUTED = ("/v1/chat/completions", "/v1/completions")
# Hop-by-hop headers (RFC 9110 section 7.6.1) and those httpx sets itself: never passed on.
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "upgrade", "te", "trailer", "proxy-authorization",
               "proxy-authenticate", "host", "content-length"}  # fmt: skip


def affinity_of(path: str, body: bytes) -> str | None:
    """What names the conversation of a completion request: its first message, or its prompt's beginning."""
    if path not in ROUTED:
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None  # a replica answers the 400
    if not isinstance(payload, dict):
        return None
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        return json.dumps(messages[0], sort_keys=True)
    prompt = payload.get("prompt")
    return prompt[:AFFINITY_CHARS] if isinstance(prompt, str) else None


def response_id_of(path: str, body: bytes) -> str | None:
    """The response a feedback request is about."""
    if path != "/v1/feedback":
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    response_id = payload.get("response_id") if isinstance(payload, dict) else None
    return response_id if isinstance(response_id, str) else None


def error_body(message: str, kind: str = "service_unavailable", code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


def create_front(replicas: ReplicaSet, server_config: ServerConfig) -> FastAPI:
    """The front's app over ``replicas``; its lifespan watches them."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(max_connections=None))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(replicas.watch_forever())
        try:
            yield
        finally:
            watcher.cancel()
            await client.aclose()

    app = FastAPI(title="alchemist front", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.keys = KeyStore(server_config.api_key, server_config.api_keys_file)
    app.state.limits = KeyLimits(LimitConfig.of(server_config), record_bytes_per_token=0)  # records: per replica
    app.state.server_config = server_config

    async def handle(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    for exc_class in (AuthenticationError, PermissionDeniedError, RateLimitError, StarletteHTTPException):
        app.add_exception_handler(exc_class, handle)

    @app.get("/v1/replicas")
    async def list_replicas(caller: Caller = Depends(admin)) -> dict:
        return {"object": "list", "data": [_describe(h) for h in replicas.handles]}

    @app.get("/metrics")
    async def metrics(caller: Caller = Depends(metrics_reader)) -> Response:
        return Response(generate_latest(replicas.registry), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(request: Request, path: str) -> Response:
        body = await request.body()
        close_stream = await _admit(request, body)
        try:
            return await _forward(request, body, replicas, client, close_stream)
        except BaseException:
            close_stream()
            raise

    return app


def _describe(handle: Handle) -> dict:
    info = handle.info
    return {
        "id": handle.index,
        "state": handle.state,
        "node": info.node if info else None,
        "pid": info.pid if info else None,
        "url": info.url if info else None,
        "adapter_version": info.adapter_version if info else None,
        "running": info.running if info else 0,
        "waiting": info.waiting if info else 0,
        "in_flight": handle.in_flight,
        "records": info.records if info else 0,
        "training": info.training if info else None,
        "generation": info.generation if info else None,
        "error": info.error if info else None,
    }


async def _admit(request: Request, body: bytes) -> Callable[[], None]:
    """The caller's limits over all replicas: a completion within its key's request rate and, streamed, its streams
    (returns what closes the stream), feedback within its feedback rate; 401, 429 as one server answers them."""
    path = "/" + request.url.path.lstrip("/")
    if request.method != "POST" or (path not in ROUTED and path != "/v1/feedback"):
        return _nothing
    caller = await user(request, await bearer(request))
    limits: KeyLimits = request.app.state.limits
    if path == "/v1/feedback":
        limits.admit_feedback(caller)
        return _nothing
    limits.admit_request(caller)
    return limits.open_stream(caller) if _streamed(body) else _nothing


def _nothing() -> None:
    pass


def _streamed(body: bytes) -> bool:
    try:
        payload = json.loads(body)
    except ValueError:
        return False  # a replica answers the 400
    return isinstance(payload, dict) and payload.get("stream") is True


async def _forward(
    request: Request, body: bytes, replicas: ReplicaSet, client: httpx.AsyncClient, close_stream: Callable[[], None]
) -> Response:
    path = "/" + request.url.path.lstrip("/")
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
    affinity, response_id = affinity_of(path, body), response_id_of(path, body)
    tried: set[int] = set()
    while True:  # a replica that cannot be reached has not seen the request: the next one may take it
        try:
            if response_id is not None:
                handle, reason = replicas.for_feedback(response_id, tried), "record"
            elif path in ROUTED:
                handle, reason = replicas.pick(affinity, tried)
            else:
                handle, reason = replicas.stable(tried), "stable"
        except NoReplicaError as e:
            close_stream()
            return Response(error_body(str(e)), status_code=503, media_type="application/json")
        assert handle.info is not None and handle.info.url is not None
        url = handle.info.url + path + (f"?{request.url.query}" if request.url.query else "")
        upstream = client.build_request(request.method, url, headers=headers, content=body)
        handle.in_flight += 1
        try:
            response = await client.send(upstream, stream=True)
        except httpx.TransportError:
            handle.in_flight -= 1
            replicas.mark_dead(handle)
            tried.add(handle.index)
            continue
        replicas.routed.labels(str(handle.index), reason).inc()
        return StreamingResponse(
            _relay(response, handle, replicas, close_stream),
            status_code=response.status_code,
            headers={k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS},
        )


async def _relay(
    response: httpx.Response, handle: Handle, replicas: ReplicaSet, close_stream: Callable[[], None]
) -> AsyncIterator[bytes]:
    """The replica's answer as it comes; if the replica dies mid-stream, an error event (the stream's own format:
    server-sent events) and the end."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.TransportError:
        replicas.mark_dead(handle)
        replicas.cut.inc()
        message = f"replica {handle.index} stopped while answering; send the request again"
        yield b"data: " + error_body(message, "internal_server_error", "replica_lost") + b"\n\n"
    finally:
        handle.in_flight -= 1
        close_stream()
        await response.aclose()
