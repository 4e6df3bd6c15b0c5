"""The model's routes: OpenAI's chat and text completions and models, and the token tools /tokenize, /detokenize."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from statelm.api.errors import APIError
from statelm.api.openai.chat import ChatService
from statelm.api.openai.completions import CompletionService
from statelm.api.openai.completions_protocol import CompletionRequest, CompletionResponse
from statelm.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeletedCompletion,
    ModelCard,
    ModelList,
    StoredChatCompletion,
)
from statelm.api.serving import ServingContext, effective_defaults
from statelm.api.sessions import session_api_error
from statelm.api.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)
from statelm.engine.client import EngineError
from statelm.sessions.errors import SessionError
from statelm.sessions.ownership import current_principal

router = APIRouter()  # OpenAI's routes live under /v1, the token tools at the root, as in vLLM
T = TypeVar("T")


def chat_service(request: Request) -> ChatService:
    """The chat service of the running app."""
    return request.app.state.chat


def serving_context(request: Request) -> ServingContext:
    """What the running app's endpoints serve from."""
    return chat_service(request).context


@router.get("/v1/models", tags=["openai"])
async def list_models(request: Request) -> ModelList:
    """The model this server generates with, then the models it only embeds or reranks with."""
    context = serving_context(request)
    model = context.model
    card = ModelCard(
        id=model.name,
        created=model.created,
        max_model_len=model.max_model_len,
        sampling_defaults=effective_defaults(context.defaults),
    )
    encoders = [
        ModelCard(
            id=encoder.served.name,
            created=encoder.served.created,
            max_model_len=encoder.served.max_model_len,
            kind="reranker" if encoder.cross_encoder else "embedding",
        )
        for encoder in request.app.state.embeddings.models.models
        if encoder.served.name != model.name
    ]
    return ModelList(data=[card, *encoders])


@router.post("/v1/chat/completions", response_model=None, tags=["openai"])
async def chat_completions(
    body: ChatCompletionRequest, request: Request
) -> ChatCompletionResponse | EventSourceResponse:
    """Create a chat completion, streamed as server-sent events when `stream` is true."""
    service = chat_service(request)
    return await generation_response(
        request, body.stream, lambda: service.complete(body), lambda: service.stream(body), _sse
    )


@router.get("/v1/chat/completions/{completion_id}", tags=["openai"])
async def stored_completion(completion_id: str, request: Request) -> StoredChatCompletion:
    """A chat completion made with `store: true`, with its metadata."""
    return chat_service(request).completions.get(current_principal(), completion_id)


@router.delete("/v1/chat/completions/{completion_id}", tags=["openai"])
async def delete_stored_completion(completion_id: str, request: Request) -> DeletedCompletion:
    """Forget a stored chat completion."""
    chat_service(request).completions.delete(current_principal(), completion_id)
    return DeletedCompletion(id=completion_id)


@router.post("/v1/completions", response_model=None, tags=["openai"])
async def completions(body: CompletionRequest, request: Request) -> CompletionResponse | EventSourceResponse:
    """Create a text completion of one or more prompts, streamed as server-sent events when `stream` is true."""
    service = CompletionService(serving_context(request))
    return await generation_response(
        request, body.stream, lambda: service.complete(body), lambda: service.stream(body), _sse
    )


@router.post("/tokenize", tags=["tokens"])
async def tokenize_route(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """Token ids of a text, or of a conversation as the chat template renders it."""
    return await tokenize(serving_context(request), body)


@router.post("/detokenize", tags=["tokens"])
async def detokenize_route(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of token ids."""
    return detokenize(serving_context(request), body)


async def generation_response(
    request: Request,
    streamed: bool,
    whole: Callable[[], Awaitable[T]],
    start_stream: Callable[[], Awaitable[AsyncIterator[Any]]],
    as_events: Callable[[AsyncIterator[Any]], AsyncIterator[dict[str, str]]],
    ping: Callable[[], ServerSentEvent] | None = None,
) -> T | EventSourceResponse:
    """A generation route's answer: the whole body (cancelled if the client leaves first), or its stream as
    server-sent events with `ping` (default: a comment) as keep-alive (an engine failure before either is a 500:
    statelm.server.errors)."""
    if not streamed:
        return await cancel_on_disconnect(request, whole())
    items = await start_stream()
    keepalive = request.app.state.sse_keepalive
    return EventSourceResponse(as_events(items), ping=keepalive, ping_message_factory=ping)


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await work, cancelling it if the client disconnects first (a dropped session turn then changes nothing)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise APIError("the client disconnected", status=499, code="client_disconnected")


async def _sse(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[dict[str, str]]:
    """Server-sent events of a stream, an error event if it fails midway (a session turn that could not be saved
    among them: its last chunk, with the finish reason, is then never sent), and the closing [DONE]."""
    try:
        async for chunk in chunks:
            yield {"data": chunk.model_dump_json()}
    except EngineError as exc:
        yield {"data": json.dumps(APIError(str(exc), status=500, type="server_error").to_dict())}
    except SessionError as exc:
        yield {"data": json.dumps(session_api_error(exc).to_dict())}
    yield {"data": "[DONE]"}
