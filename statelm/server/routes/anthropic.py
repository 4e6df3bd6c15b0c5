"""Anthropic's Messages API: create a message (whole or as Anthropic's server-sent events) and count its tokens."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse, ServerSentEvent

from statelm.api.anthropic.output import Event
from statelm.api.anthropic.protocol import CountTokensRequest, MessageObject, MessagesRequest, TokenCount
from statelm.api.anthropic.service import MessagesService
from statelm.server.routes.openai import generation_response

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/messages", tags=["anthropic"])
KNOWN_BETAS: frozenset[str] = frozenset()  # statelm serves no beta feature: each one named is ignored, logged once


def messages_service(request: Request) -> MessagesService:
    """The messages service of the running app."""
    return request.app.state.messages


@router.post("", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> MessageObject | EventSourceResponse:
    """Create a message, streamed as Anthropic's server-sent events when `stream` is true."""
    note_betas(request)
    service = messages_service(request)
    return await generation_response(
        request, body.stream, lambda: service.create(body), lambda: service.stream(body), _sse, ping=_ping
    )


@router.post("/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> TokenCount:
    """How many tokens the message's prompt would have."""
    note_betas(request)
    return await messages_service(request).count_tokens(body)


def note_betas(request: Request) -> None:
    """Log, once per name, each `anthropic-beta` feature the request names that statelm does not serve."""
    noted: set[str] = request.app.state.noted_betas
    for beta in request.headers.get("anthropic-beta", "").split(","):
        name = beta.strip()
        if name and name not in KNOWN_BETAS and name not in noted:
            noted.add(name)
            log.info("ignoring the anthropic-beta feature %r, which statelm does not serve", name)


def _ping() -> ServerSentEvent:
    """Anthropic's keep-alive event."""
    return ServerSentEvent(event="ping", data=json.dumps({"type": "ping"}))


async def _sse(events: AsyncIterator[Event]) -> AsyncIterator[dict[str, str]]:
    """Each event as `event: <type>` and its JSON; the stream ends after the last."""
    async for event in events:
        yield {"event": event["type"], "data": json.dumps(event, ensure_ascii=False)}
