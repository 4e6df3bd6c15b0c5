"""One place that turns every error into the error shape of the protocol its route speaks, with the right status:
Anthropic's on /v1/messages, OpenAI's everywhere else."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from statelm.api.anthropic.errors import anthropic_error, anthropic_status
from statelm.api.errors import APIError
from statelm.api.sessions import session_api_error
from statelm.engine.client import EngineError
from statelm.sessions.errors import SessionError

log = logging.getLogger(__name__)

_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
REQUEST_PARTS = frozenset({"body", "query", "path", "header", "cookie"})  # where FastAPI says a value was
ANTHROPIC_PREFIX = "/v1/messages"
_HTTP_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def speaks_anthropic(path: str) -> bool:
    """Whether the route at path is one of Anthropic's (its errors then take Anthropic's shape)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_body(error: APIError, path: str) -> dict[str, Any]:
    """An error's body in the shape of the route at path (the body of a stream's error event too)."""
    return anthropic_error(error) if speaks_anthropic(path) else error.to_dict()


def error_response(error: APIError, path: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """JSON response for an APIError on the route at path, with the error's headers and headers."""
    status = anthropic_status(error) if speaks_anthropic(path) else error.status
    return JSONResponse(
        error_body(error, path), status_code=status, headers={**(error.headers or {}), **(headers or {})}
    )


def validation_error(errors: Sequence[Mapping[str, Any]], body: Any = None) -> APIError:
    """The most specific problem pydantic found, named by its parameter.

    For a union field pydantic reports one error per member; the deepest error that is not merely a type
    mismatch against another member is the one that explains what is wrong. With the request's parsed body, the
    union members' tags in its location (`NamedToolChoice`, `json_schema`) are left out of the parameter's name.
    """
    first = max(errors, key=lambda e: (len(e.get("loc", ())), not str(e.get("type", "")).endswith("_type")))
    location = _parameter_path(first, body)
    param = ".".join(location) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", param=param, code="unsupported_parameter")
    if kind in ("json_invalid", "model_attributes_type") or not location:
        return APIError(f"Request body is not a valid JSON object: {first.get('msg', '')}", code="invalid_json")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


def _parameter_path(error: Mapping[str, Any], body: Any) -> list[str]:
    """The parts of an error's location that name places in the body: keys and indexes, not union tags.

    A part the body does not have at that place is a tag, except the last one of a missing field.
    """
    loc = list(error.get("loc", ()))
    if not loc or loc[0] != "body" or not isinstance(body, dict):
        parts = loc[1:] if loc and loc[0] in REQUEST_PARTS else loc
        return [str(part) for part in parts if not _is_type_tag(part)]
    named: list[str] = []
    current: Any = body
    for position, part in enumerate(loc[1:], start=2):
        if (isinstance(current, dict) and part in current) or (
            isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current)
        ):
            current = current[part]
        elif not (position == len(loc) and error.get("type") == "missing"):
            continue
        named.append(str(part))
    return named


def _is_type_tag(part: object) -> bool:
    """Location parts like `str` or `list[TextContentPart]` name a union member, not a field."""
    return isinstance(part, str) and ("[" in part or part in _UNION_MEMBER_TAGS)


def allowed_methods(request: Request) -> str:
    """The methods of every route on the request's path (Starlette names only those of the first route)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that keep every error in its route's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(SessionError)
    async def _session_error(request: Request, exc: SessionError) -> JSONResponse:
        return error_response(session_api_error(exc), request.url.path)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return error_response(APIError(str(exc), status=500, type="server_error"), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors(), exc.body), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        headers = {"Allow": allowed_methods(request)} if exc.status_code == 405 else exc.headers
        return error_response(APIError(str(exc.detail), status=exc.status_code, type=kind), request.url.path, headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(APIError(f"internal error: {exc}", status=500, type="server_error"), request.url.path)
