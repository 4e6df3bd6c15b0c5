"""The OpenAPI schema as the server really answers: each route's errors in its protocol's shape (Anthropic's on
/v1/messages, OpenAI's elsewhere), and its API keys."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from statelm.api.anthropic.errors import OVERLOADED
from statelm.server.errors import speaks_anthropic

ERROR_STATUSES = {
    400: "Invalid request",
    401: "Missing or wrong API key",
    404: "No such route, model, session or snapshot (or one another key owns)",
    405: "Method not allowed",
    409: "Conflict: the id exists, the session is busy, or the snapshot was made with another model",
    413: "Request body too large",
    422: "Unprocessable: a damaged snapshot or session transcript",
    429: "Too many waiting requests, or too many sessions for this key",
    500: "Internal error",
    503: "Shutting down: retry after the Retry-After seconds",
    507: "Out of room: KV pool, snapshot quota, or a state directory that cannot save the change (Retry-After)",
}
SSE_EVENT = {  # a stream's event: its data, or (when it has an `event:` line: Responses, Anthropic) both
    "anyOf": [
        {"type": "string"},
        {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}}},
    ]
}
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer"},
    "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "X-Api-Key"},
}


class ErrorDetail(BaseModel):
    """OpenAI's error fields."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the server answers with on OpenAI's and statelm's routes."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    """Anthropic's error fields."""

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error the server answers with on Anthropic's routes."""

    type: str
    error: AnthropicErrorDetail


def install_openapi(app: FastAPI, keyed: bool, public_paths: frozenset[str]) -> None:
    """Make app's /openapi.json document its error responses and, when keyed, the key schemes on protected routes."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _schema(app, keyed, public_paths)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _schema(app: FastAPI, keyed: bool, public_paths: frozenset[str]) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {})
    models = components.setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body, which this server never sends
        models.pop(unused, None)
    for model in (ErrorResponse, AnthropicErrorResponse):
        error_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        models.update(error_schema.pop("$defs"))
        models[model.__name__] = error_schema
    if keyed:
        components["securitySchemes"] = SECURITY_SCHEMES
    for path, operations in schema["paths"].items():
        anthropic = speaks_anthropic(path)
        model = AnthropicErrorResponse if anthropic else ErrorResponse
        error_content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
        statuses = {OVERLOADED if anthropic and s == 503 else s: d for s, d in ERROR_STATUSES.items()}
        for operation in operations.values():
            responses = operation["responses"]
            if _streams(operation, models) and "200" in responses:
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT}
            for status, description in statuses.items():
                if status == 401 and (not keyed or path in public_paths):
                    continue
                if str(status) not in responses or status == 422:
                    responses[str(status)] = {"description": description, "content": error_content}
            if keyed and path not in public_paths:
                operation["security"] = [{name: []} for name in SECURITY_SCHEMES]
    return schema


def _streams(operation: dict[str, Any], models: dict[str, Any]) -> bool:
    """Whether an operation's body has a `stream` flag, so that its 200 may be server-sent events."""
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    reference = body.get("$ref", "")
    properties = models.get(reference.rsplit("/", 1)[-1], {}).get("properties", {}) if reference else {}
    return "stream" in properties
