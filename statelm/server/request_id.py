"""A `request-id` header on every answer, which Anthropic's clients report with errors."""

from __future__ import annotations

import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import Message, Receive, Scope, Send

from statelm.server.http_middleware import HttpMiddleware

REQUEST_ID_HEADER = "request-id"


class RequestIdMiddleware(HttpMiddleware):
    """Gives each HTTP request an id (`req_…`) and sends it back as the `request-id` header."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the request, adding its id to the answer's headers."""
        request_id = f"req_{uuid.uuid4().hex}"

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)
