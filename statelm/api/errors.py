"""Errors the API layer raises; the server maps them to OpenAI's error shape."""

from __future__ import annotations


class APIError(Exception):
    """An error with an HTTP status, OpenAI's type/param/code fields, and any headers it is answered with."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # sent with the error (Retry-After)

    def to_dict(self) -> dict[str, dict[str, str | None]]:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def queue_full(max_queue: int) -> APIError:
    """The 429 for a full request queue."""
    return APIError(
        f"The server is at capacity ({max_queue} requests waiting); retry shortly.",
        status=429,
        type="rate_limit_error",
        code="queue_full",
    )
