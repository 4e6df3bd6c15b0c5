"""One place that turns every error into OpenAI's error shape with the right status."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from statelm.api.errors import APIError

log = logging.getLogger(__name__)

_HTTP_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


def error_response(error: APIError) -> JSONResponse:
    """JSON response for an APIError."""
    return JSONResponse(error.to_dict(), status_code=error.status)


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, named by its parameter."""
    first = exc.errors()[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", param=param, code="unsupported_parameter")
    if kind in ("json_invalid", "model_attributes_type") or not location:
        return APIError(f"Request body is not a valid JSON object: {first.get('msg', '')}", code="invalid_json")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that keep every error in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        return error_response(APIError(str(exc.detail), status=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(APIError(f"internal error: {exc}", status=500, type="server_error"))
