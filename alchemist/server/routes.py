"""The HTTP routes: parse, call the service, wrap the result. Errors are raised, and mapped in ``app.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from alchemist.server.protocol import (
    AdapterInfo,
    AdapterList,
    ChatCompletionRequest,
    CompletionRequest,
    FeedbackInfo,
    FeedbackList,
    FeedbackRequest,
    FeedbackResponse,
    ModelList,
    RollbackRequest,
)
from alchemist.server.service import EventStream, OpenAIServing

router = APIRouter()
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away; nobody receives it


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    return _serving(request).models()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _respond(request, _serving(request).chat(body))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _respond(request, _serving(request).completion(body))


@router.post("/v1/feedback")
def feedback(body: FeedbackRequest, request: Request) -> FeedbackResponse:
    # A plain def: FastAPI runs it in its thread pool, so the log's fsync does not stall the event loop.
    return request.app.state.feedback.submit(body)


@router.get("/v1/feedback")
def feedback_list(request: Request, state: str | None = None, after: str | None = None, limit: int = 100) -> (
    FeedbackList
):
    # A plain def: a read of the SQLite log, off the event loop.
    return request.app.state.feedback.entries(state, after, limit)


@router.get("/v1/feedback/{feedback_id}")
def feedback_entry(feedback_id: str, request: Request) -> FeedbackInfo:
    # A plain def: a read of the SQLite log, off the event loop.
    return request.app.state.feedback.get(feedback_id)


@router.get("/v1/dashboard/series")
async def dashboard_series(request: Request, since: float | None = None) -> dict[str, Any]:
    """The dashboard's time series (``alchemist.server.series``): the points after unix time ``since``."""
    series = request.app.state.series
    if series is None:
        raise ValueError("this server keeps no dashboard series")
    return series.snapshot(since)


@router.get("/v1/adapters")
def adapters(request: Request) -> AdapterList:
    return request.app.state.adapters.list()


@router.post("/v1/adapters/rollback")
def rollback(body: RollbackRequest, request: Request) -> AdapterInfo:
    # A plain def: it waits for the training slice in progress and writes a checkpoint, off the event loop.
    return request.app.state.adapters.rollback(body)


async def _respond(request: Request, result: Awaitable[Any]) -> Response:
    """A JSON body, or an SSE stream. A stream is aborted by Starlette's own disconnect watch (it cancels the
    iterator); a non-streaming request is watched here, so that a client that gives up frees its slot too."""
    task = asyncio.ensure_future(result)
    watcher = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:
        task.cancel()  # CancelledError inside the service closes the request's stream, which aborts it
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    watcher.cancel()
    out = task.result()
    if isinstance(out, EventStream):
        return SSEResponse(out, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return Response(out.model_dump_json(), media_type="application/json")


class SSEResponse(StreamingResponse):
    """Closes its EventStream however the response ends (done, client gone, server shutting down)."""

    body_iterator: EventStream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
