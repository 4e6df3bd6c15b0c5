"""Graceful drain: on SIGTERM or SIGINT stop taking requests (503), let running ones finish, then shut down.

uvicorn alone stops at the first signal: it closes the listening socket and sse-starlette ends every open
stream at once. DrainingServer instead answers new requests 503 with Retry-After while the running ones
(streams included) finish, up to the drain timeout; then uvicorn shuts down as usual, the app's lifespan
saves the sessions, and the process exits with status 0. A second signal ends the drain at once.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from statelm.api.errors import APIError
from statelm.server.errors import error_response
from statelm.server.http_middleware import HttpMiddleware

log = logging.getLogger(__name__)


class DrainGate:
    """Counts the requests in flight and, once draining, turns new ones away."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.in_flight = 0

    def retry_after(self) -> str:
        """Seconds a turned-away client should wait before it retries (the drain timeout, at least 1)."""
        return str(max(1, math.ceil(self.timeout_s)))


class DrainMiddleware(HttpMiddleware):
    """Answers 503 with Retry-After once the gate drains (except on exempt paths) and counts requests in flight."""

    def __init__(self, app: ASGIApp, gate: DrainGate, exempt_paths: frozenset[str]) -> None:
        super().__init__(app)
        self.gate = gate
        self.exempt_paths = exempt_paths

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, counted, or turn it away while draining."""
        if scope["path"] in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        if self.gate.draining:
            error = APIError(
                "The server is shutting down and takes no new requests; retry shortly.",
                status=503,
                type="server_error",
                code="server_shutting_down",
            )
            await error_response(error, scope["path"], {"Retry-After": self.gate.retry_after()})(scope, receive, send)
            return
        self.gate.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM or SIGINT drains the gate before shutting down."""

    def __init__(self, config: uvicorn.Config, gate: DrainGate) -> None:
        super().__init__(config)
        self.gate = gate
        self._deadline: float | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start serving; say where (uvicorn says so itself only when it binds the address)."""
        await super().startup(sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            address = f"[{host}]" if ":" in host else host
            log.info("serving on http://%s:%d (SIGINT or SIGTERM drains, then stops)", address, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: start draining; a second one: shut down now. Never re-raised, so the exit status is 0."""
        if self._deadline is None:
            in_flight, timeout = self.gate.in_flight, self.gate.timeout_s
            log.info("signal %d: draining %d requests in flight (for at most %.0fs)", sig, in_flight, timeout)
            self.gate.draining = True
            self._deadline = time.monotonic() + self.gate.timeout_s
        else:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """Shut down once a drain has no request left in flight or its time is up."""
        if self._deadline is not None and not self.should_exit:
            if self.gate.in_flight == 0:
                self.should_exit = True
            elif time.monotonic() >= self._deadline:
                log.warning("drain timeout: cutting %d requests still in flight", self.gate.in_flight)
                self.should_exit = True
        return await super().on_tick(counter)
