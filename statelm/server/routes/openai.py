"""OpenAI-compatible routes: chat completions and models."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from statelm.api.chat import ChatService
from statelm.api.errors import APIError
from statelm.api.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ModelCard,
    ModelList,
)
from statelm.engine.async_engine import EngineError

router = APIRouter(prefix="/v1", tags=["openai"])
KEEP_ALIVE_SECONDS = 10


def chat_service(request: Request) -> ChatService:
    """The chat service of the running app."""
    return request.app.state.chat


@router.get("/models")
async def list_models(request: Request) -> ModelList:
    """The one model this server serves."""
    model = chat_service(request).model
    return ModelList(data=[ModelCard(id=model.name, created=model.created, max_model_len=model.max_model_len)])


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request
) -> ChatCompletionResponse | EventSourceResponse:
    """Create a chat completion, streamed as server-sent events when `stream` is true."""
    service = chat_service(request)
    try:
        if not body.stream:
            return await service.complete(body)
        chunks = await service.stream(body)
    except EngineError as exc:
        raise APIError(str(exc), status=500, type="server_error") from exc
    return EventSourceResponse(_sse(chunks), ping=KEEP_ALIVE_SECONDS)


async def _sse(chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[dict[str, str]]:
    """Server-sent events of a stream, an error event if it fails midway, and the closing [DONE]."""
    try:
        async for chunk in chunks:
            yield {"data": chunk.model_dump_json()}
    except EngineError as exc:
        yield {"data": json.dumps(APIError(str(exc), status=500, type="server_error").to_dict())}
    yield {"data": "[DONE]"}
