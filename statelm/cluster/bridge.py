"""HTTP requests carried over Ray Serve: the router sends a request's parts, the replica runs its ASGI app on them
and streams back the app's ASGI messages (response start, body chunks), so streams stay streams."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Scope

Headers = list[tuple[bytes, bytes]]
DRAINING: Message = {"type": "statelm.replica.draining"}  # instead of an answer: the replica takes no new request


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request with its whole body, as the router received it."""

    method: str
    path: str
    query_string: bytes
    headers: Headers
    body: bytes
    client: tuple[str, int] | None = None

    @classmethod
    def from_scope(cls, scope: Scope, body: bytes) -> ForwardedRequest:
        """The request an ASGI scope describes, with its body read."""
        client = scope.get("client")
        return cls(
            scope["method"],
            scope["path"],
            scope.get("query_string", b""),
            list(scope["headers"]),
            body,
            tuple(client) if client else None,
        )

    def scope(self) -> Scope:
        """An ASGI HTTP scope for this request."""
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "root_path": "",
            "query_string": self.query_string,
            "headers": self.headers,
            "client": self.client,
            "server": None,
        }


async def run_app(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[Message]:
    """The ASGI messages app sends in answer to request; closing this generator is the client going away."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(request.scope(), receive, send)
        finally:
            messages.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            yield message
        await task  # an error the app let out
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
