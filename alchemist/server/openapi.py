"""The OpenAPI schema tells what the server really answers: each route's error statuses with the OpenAI error
envelope, JSON or SSE for completions, /metrics as Prometheus text.

    @router.post("/v1/feedback", responses=errors(400, 401, 403, 404, 413, 429))
    install_openapi(app)   # drops FastAPI's default 422: a validation error is a 400 here (app.ERROR_MAP)

The routes declare their statuses next to their code; ``tests/server/test_schemathesis.py`` holds the server to
them, over the live process.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel

from alchemist.server.auth import docs_reader
from alchemist.server.protocol import ErrorResponse

ERROR_DESCRIPTIONS = {
    400: "Invalid request (malformed JSON, a wrong type or value, a prompt beyond the context)",
    401: "Missing or wrong API key (Authorization: Bearer ...)",
    403: "The key may not do this (an admin key is needed, the response belongs to another key, or the adapter "
    "named as model is another key's)",
    404: "Unknown model, response id, adapter version or adapter name",
    409: "Conflict (a reused feedback_id, or feedback on a response of a named adapter, which is served frozen)",
    413: "Request body too large",
    429: "Rate limit of the key, or the server's waiting queue is full (see Retry-After)",
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}}
TEXT = {"schema": {"type": "string"}}
# One server-sent event (before OpenAPI 3.2 a text/event-stream schema describes each event): its data is a JSON
# chunk of the completion, or [DONE] at the end.
SSE_EVENT = {
    "schema": {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
    }
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route that answers these error statuses, each in the OpenAI error envelope."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
        if status == 429:
            out[status]["headers"] = RETRY_AFTER
    return out


def json_or_stream(model: type[BaseModel], *statuses: int) -> dict[int | str, dict[str, Any]]:
    """A completion route: ``model`` as JSON, or server-sent events with ``"stream": true``; then its errors."""
    ok = {
        "model": model,
        "description": "The completion, or its SSE stream",
        "content": {"text/event-stream": SSE_EVENT},
    }
    return {200: ok, **errors(*statuses)}


def text(description: str, *statuses: int) -> dict[int | str, dict[str, Any]]:
    """A plain-text route (/metrics)."""
    return {200: {"description": description, "content": {"text/plain": TEXT}}, **errors(*statuses)}


# FastAPI's own /docs and /openapi.json are off (FastAPI(docs_url=None, openapi_url=None)): these take a key
# unless --docs-access public.
docs_router = APIRouter(include_in_schema=False, dependencies=[Depends(docs_reader)])


@docs_router.get("/openapi.json")
def openapi_json(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@docs_router.get("/docs")
def docs() -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="alchemist")


def install_openapi(app: FastAPI) -> None:
    """Replace FastAPI's schema builder by one without the 422 it adds to every route with a body: this server
    answers validation errors with 400 in the OpenAI envelope."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
