"""OpenAI's Responses API: create (whole or as typed server-sent events), retrieve, delete, input items."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from sse_starlette import EventSourceResponse

from statelm.api.errors import APIError
from statelm.api.responses.objects import DeletedResponse, InputItemList, ResponseObject
from statelm.api.responses.output import Event
from statelm.api.responses.protocol import ResponsesRequest
from statelm.api.responses.service import ResponsesService
from statelm.server.routes.openai import generation_response

router = APIRouter(prefix="/v1/responses", tags=["openai"])
MAX_PAGE = 100


def responses_service(request: Request) -> ResponsesService:
    """The responses service of the running app."""
    return request.app.state.responses


@router.post("", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> ResponseObject | EventSourceResponse:
    """Create a response, streamed as OpenAI's typed server-sent events when `stream` is true."""
    service = responses_service(request)
    return await generation_response(
        request, body.stream, lambda: service.create(body), lambda: service.stream(body), _sse
    )


@router.get("/{response_id}")
async def retrieve_response(
    response_id: str,
    request: Request,
    include: Annotated[list[str] | None, Query()] = None,
    stream: bool = False,
) -> ResponseObject:
    """A stored response (its stream is not replayed: statelm runs no background responses)."""
    if include:
        raise APIError("a stored response has nothing more to include", param="include")
    if stream:
        raise APIError("statelm runs no background responses, so there is no stream to replay", param="stream")
    return responses_service(request).get(response_id)


@router.delete("/{response_id}")
async def delete_response(response_id: str, request: Request) -> DeletedResponse:
    """Forget a stored response, freeing the KV and transcript only it held."""
    return await responses_service(request).delete(response_id)


@router.post("/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> ResponseObject:
    """Only background responses can be cancelled, and statelm runs none: 400 for a stored response."""
    responses_service(request).get(response_id)
    raise APIError("only background responses can be cancelled; statelm runs none", code="not_background")


@router.get("/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 20,
    order: Literal["asc", "desc"] = "desc",
    include: Annotated[list[str] | None, Query()] = None,
) -> InputItemList:
    """A page of a stored response's input items, with their ids."""
    if include:
        raise APIError("input items have nothing more to include", param="include")
    return responses_service(request).input_items(response_id, after, limit, order)


async def _sse(events: AsyncIterator[Event]) -> AsyncIterator[dict[str, str]]:
    """Each event as `event: <type>` and its JSON; the stream ends after the last (no [DONE])."""
    async for event in events:
        yield {"event": event["type"], "data": json.dumps(event, ensure_ascii=False)}
