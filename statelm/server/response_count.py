"""Counts HTTP responses by route and status as they start, without wrapping the body (a plain ASGI middleware)."""

from __future__ import annotations

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from statelm.server.http_middleware import HttpMiddleware


class ResponseCountMiddleware(HttpMiddleware):
    """Adds one to `counter` (labels: the matched route's path or `unmatched`, the status) per HTTP response.

    Starlette's function middleware (`@app.middleware("http")`) would pass every streamed chunk through a task and
    a memory stream of its own; this one only looks at the response's start.
    """

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        super().__init__(app)
        self.counter = counter

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the request, counting its response when it starts."""

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                path = getattr(scope.get("route"), "path", "unmatched")  # the router set it while routing
                self.counter.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
