"""Request limits enforced before a route runs: body size (413), text that is not Unicode and the caps a
generation body states (400)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from statelm.api.errors import APIError
from statelm.api.limits import GenerationLimits
from statelm.server.errors import error_response
from statelm.server.http_middleware import HttpMiddleware

CAPPED_PATHS = frozenset(  # generation bodies
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/tokenize",
    }
)
OFF_LOOP_BYTES = 2**20  # bodies larger than this are checked in a worker thread
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # JSON's \uD800-\uDFFF, pairs included
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # what is left of one once JSON has joined the pairs


def body_too_large(limit: int) -> APIError:
    """413 for a request body over limit bytes."""
    return APIError(
        f"The request body is larger than this server's limit of {limit} bytes.", status=413, code="request_too_large"
    )


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """A request's whole body; None once it passes limit bytes."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


class RequestLimitMiddleware(HttpMiddleware):
    """Reads each request body up to max_body_bytes (413 past it) and checks capped routes' bodies against limits."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, limits: GenerationLimits) -> None:
        super().__init__(app)
        self.max_body_bytes = max_body_bytes
        self.limits = limits

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on with its body buffered, or answer with the limit it breaks."""
        try:
            body = await self._read_body(scope, receive)
            if len(body) > OFF_LOOP_BYTES:  # parsing a large body would hold up every other request
                await asyncio.to_thread(self._check_body, scope, body)
            else:
                self._check_body(scope, body)
        except APIError as error:
            await error_response(error, scope["path"])(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise body_too_large(self.max_body_bytes)
        body = await read_body(receive, self.max_body_bytes)
        if body is None:
            raise body_too_large(self.max_body_bytes)
        return body

    def _check_body(self, scope: Scope, body: bytes) -> None:
        check_unicode(body)
        if scope["method"] == "POST" and scope["path"] in CAPPED_PATHS:
            self._check_generation(body)

    def _check_generation(self, body: bytes) -> None:
        """Caps on the body as sent; a body that is not a JSON object is left for the route to reject."""
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):
            return
        if isinstance(parsed, dict):
            self.limits.check_body(parsed)


def check_unicode(body: bytes) -> None:
    """400 naming the field when a JSON body holds a lone UTF-16 surrogate (`"\\ud800"`: valid JSON, not text).

    Only a body with a surrogate escape is parsed here; one that is not JSON is left for the route to reject.
    """
    if not SURROGATE_ESCAPE.search(body):
        return
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return
    path = _lone_surrogate(parsed, [])
    if path is not None:
        param = ".".join(path) or None
        raise APIError(
            f"Invalid value for '{param}': the text holds a lone UTF-16 surrogate, which is not a Unicode "
            "character; send valid Unicode (a surrogate escape only as half of a pair).",
            param=param,
            code="invalid_value",
        )


def _lone_surrogate(value: Any, path: list[str]) -> list[str] | None:
    """Where in a parsed JSON value the first string (or key) with a lone surrogate is, or None."""
    if isinstance(value, str):
        return path if LONE_SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and LONE_SURROGATE.search(key):
            return [*path, key.encode("utf-8", "backslashreplace").decode()]
        found = _lone_surrogate(item, [*path, str(key)])
        if found is not None:
            return found
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the buffered body once, then waits on the client as before (for disconnects)."""
    pending = True

    async def replayed() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
