"""HTTP requests carried over Ray Serve: the router sends a request's parts, the replica runs its ASGI app on them
and streams back the app's ASGI messages (response start, body chunks), so streams stay streams.

Messages travel in batches: each streamed item is every message the app has sent by then, and a response's start
waits for its first body part. An item costs a Ray round of its own (about a millisecond here), so a whole answer
(start and body) is one item, and a stream's start goes with its first chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Scope

Headers = list[tuple[bytes, bytes]]
DRAINING: list[Message] = [{"type": "statelm.replica.draining"}]  # instead of an answer: it takes no new request


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


async def run_app(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[list[Message]]:
    """The ASGI messages app sends in answer to request, in batches; closing this generator is the client going
    away."""
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
        while (batch := await _next_batch(messages)) is not None:
            yield batch
        await task  # an error the app let out
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _next_batch(messages: asyncio.Queue[Message | None]) -> list[Message] | None:
    """Every message queued now (at least one, and a response start with the part that follows it); None once the
    app is done (the None it queued last)."""
    first = await messages.get()
    if first is None:
        return None
    batch = [first]
    while True:
        if batch[-1]["type"] == "http.response.start":
            message = await messages.get()
        elif not messages.empty():
            message = messages.get_nowait()
        else:
            return batch
        if message is None:
            messages.put_nowait(None)  # the end, for the next call
            return batch
        batch.append(message)
