"""The shape statelm's ASGI middlewares share: HTTP requests handled, every other scope passed straight on."""

from __future__ import annotations

from abc import ABC, abstractmethod

from starlette.types import ASGIApp, Receive, Scope, Send


class HttpMiddleware(ABC):
    """An ASGI middleware around `app` that acts on HTTP requests only (lifespan and websocket scopes pass through)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Hand an HTTP request to `handle`, anything else to the app."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    @abstractmethod
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one HTTP request, calling the app or answering it."""
