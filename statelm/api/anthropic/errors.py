"""statelm's errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}` and its statuses."""

from __future__ import annotations

from typing import Any

from statelm.api.errors import APIError

OVERLOADED = 529  # Anthropic's status for a server that cannot take the request now
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED: "overloaded_error",
}
STATUSES = {503: OVERLOADED}  # statelm's statuses that Anthropic's clients know by another


def anthropic_status(error: APIError) -> int:
    """The HTTP status an error is answered with on Anthropic's routes."""
    return STATUSES.get(error.status, error.status)


def anthropic_error(error: APIError) -> dict[str, Any]:
    """An error's body on Anthropic's routes (the body of an `error` stream event too).

    Anthropic's shape has no `param`: a message that does not name its parameter starts with it, as Anthropic's do.
    """
    status = anthropic_status(error)
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}
