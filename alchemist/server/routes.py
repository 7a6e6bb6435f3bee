"""The HTTP routes: parse, call the service, wrap the result. Errors are raised, and mapped in ``app.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from alchemist.server.auth import Caller, admin, metrics_reader, user
from alchemist.server.limits import feedback_giver, requester
from alchemist.server.openapi import errors, json_or_stream, text
from alchemist.server.protocol import (
    AdapterInfo,
    AdapterList,
    AdapterSummaryList,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DeletedModel,
    FeedbackInfo,
    FeedbackList,
    FeedbackRequest,
    FeedbackResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    RollbackRequest,
    UnloadLoRAAdapterRequest,
)
from alchemist.server.service import EventStream, OpenAIServing

router = APIRouter()
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away; nobody receives it


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/v1/models", responses=errors(401))
async def models(request: Request, caller: Caller = Depends(user)) -> ModelList:
    return _serving(request).models(caller)


@router.get("/metrics", response_class=Response, responses=text("Prometheus metrics", 401, 403))
async def metrics(request: Request, caller: Caller = Depends(metrics_reader)) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


COMPLETION_ERRORS = (400, 401, 403, 404, 413, 429)


@router.post(
    "/v1/chat/completions", response_model=None, responses=json_or_stream(ChatCompletionResponse, *COMPLETION_ERRORS)
)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, caller: Caller = Depends(requester)
) -> Response:
    return await _respond(request, caller, body.stream, lambda: _serving(request).chat(body, caller))


@router.post("/v1/completions", response_model=None, responses=json_or_stream(CompletionResponse, *COMPLETION_ERRORS))
async def completions(body: CompletionRequest, request: Request, caller: Caller = Depends(requester)) -> Response:
    return await _respond(request, caller, body.stream, lambda: _serving(request).completion(body, caller))


@router.post("/v1/feedback", responses=errors(400, 401, 403, 404, 409, 413, 429))
def feedback(body: FeedbackRequest, request: Request, caller: Caller = Depends(feedback_giver)) -> FeedbackResponse:
    # A plain def: FastAPI runs it in its thread pool, so the log's fsync does not stall the event loop.
    return request.app.state.feedback.submit(body, None if caller.admin else caller.name, caller.name)


@router.get("/v1/feedback", responses=errors(400, 401, 403))
def feedback_list(
    request: Request, state: str | None = None, after: str | None = None, limit: int = 100,
    caller: Caller = Depends(admin),
) -> FeedbackList:  # fmt: skip
    # Everyone's feedback: an admin's. A plain def: a read of the SQLite log, off the event loop.
    return request.app.state.feedback.entries(state, after, limit)


@router.get("/v1/feedback/{feedback_id}", responses=errors(401, 403, 404))
def feedback_entry(feedback_id: str, request: Request, caller: Caller = Depends(user)) -> FeedbackInfo:
    # A plain def: a read of the SQLite log, off the event loop.
    return request.app.state.feedback.get(feedback_id, None if caller.admin else caller.name)


@router.get("/v1/dashboard/series", responses=errors(400, 401, 403))
async def dashboard_series(
    request: Request, since: float | None = None, caller: Caller = Depends(metrics_reader)
) -> dict[str, Any]:
    """The dashboard's time series (``alchemist.server.series``): the points after unix time ``since``; who may read
    them is who may read /metrics."""
    series = request.app.state.series
    if series is None:
        raise ValueError("this server keeps no dashboard series")
    return series.snapshot(since)


@router.get("/v1/adapters", responses=errors(401, 403, 404))
def adapters(request: Request, adapter: str | None = None, caller: Caller = Depends(user)) -> AdapterList:
    """The shared adapter's versions, or with ``adapter`` a named adapter's (one the key may use)."""
    return request.app.state.adapters.list(adapter, caller)


@router.get("/v1/adapters/summary", responses=errors(401))
async def adapters_summary(request: Request, caller: Caller = Depends(user)) -> AdapterSummaryList:
    """Every adapter the key may use at a glance: the shared one, and the named ones /v1/models lists for it. An
    async def: the adapter registry's state is the event loop's (the log's count is one small query)."""
    return request.app.state.adapters.summary(caller)


@router.post("/v1/adapters/rollback", responses=errors(400, 401, 403, 404, 413))
def rollback(body: RollbackRequest, request: Request, caller: Caller = Depends(admin)) -> AdapterInfo:
    # A plain def: it waits, off the event loop, for the stepping thread to roll back (after the batch in training).
    return request.app.state.adapters.rollback(body)


@router.post("/v1/load_lora_adapter", responses=errors(400, 401, 403, 413))
async def load_lora_adapter(
    body: LoadLoRAAdapterRequest, request: Request, caller: Caller = Depends(admin)
) -> ModelCard:
    """vLLM's: serve a PEFT adapter directory under a name, trained from then on where the server trains
    (alchemist.server.named_adapters)."""
    return await request.app.state.named_adapters.load(body)


@router.post("/v1/unload_lora_adapter", responses=errors(400, 401, 403, 404, 413))
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request, caller: Caller = Depends(admin)
) -> DeletedModel:
    """vLLM's: stop serving a named adapter (requests in flight finish with it)."""
    return request.app.state.named_adapters.unload(body)


async def _respond(request: Request, caller: Caller, stream: bool, serve: Callable[[], Awaitable[Any]]) -> Response:
    """A JSON body, or an SSE stream (one of the key's max_streams until it ends). A stream is aborted by
    Starlette's own disconnect watch (it cancels the iterator); a non-streaming request is watched here, so that a
    client that gives up frees its slot too."""
    close_stream = request.app.state.limits.open_stream(caller) if stream else None
    try:
        task = asyncio.ensure_future(serve())
        watcher = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()  # CancelledError inside the service closes the request's stream, which aborts it
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        watcher.cancel()
        out = task.result()
    except BaseException:
        if close_stream is not None:
            close_stream()
        raise
    if isinstance(out, EventStream):
        headers = {"Cache-Control": "no-cache"}
        return SSEResponse(out, close_stream, media_type="text/event-stream", headers=headers)
    if close_stream is not None:
        close_stream()
    return Response(out.model_dump_json(), media_type="application/json")


class SSEResponse(StreamingResponse):
    """Closes its EventStream however the response ends (done, client gone, server shutting down), and with it
    the key's count of open streams."""

    body_iterator: EventStream

    def __init__(self, events: EventStream, on_close: Callable[[], None] | None, **kwargs: Any):
        super().__init__(events, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            if self.on_close is not None:
                self.on_close()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
