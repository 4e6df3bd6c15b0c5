"""The OpenAPI schema as the server really answers: OpenAI-shaped errors on every route, and its API keys."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

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
    507: "Out of room: KV pool or snapshot quota",
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
    """Every error the server answers with."""

    error: ErrorDetail


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
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    models.update(error_schema.pop("$defs"))
    models["ErrorResponse"] = error_schema
    error_content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    if keyed:
        components["securitySchemes"] = SECURITY_SCHEMES
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            responses = operation["responses"]
            if _streams(operation, models) and "200" in responses:
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
            for status, description in ERROR_STATUSES.items():
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
