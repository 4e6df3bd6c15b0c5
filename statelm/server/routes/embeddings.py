"""The embedding routes: OpenAI's /v1/embeddings, and /v1/rerank and /v1/score as vLLM and llama.cpp serve them."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from fastapi import APIRouter, Request

from statelm.api.embeddings.protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from statelm.api.embeddings.service import EmbeddingService
from statelm.api.errors import APIError
from statelm.engine.client import EngineError
from statelm.server.routes.openai import cancel_on_disconnect

router = APIRouter()
T = TypeVar("T")


def embedding_service(request: Request) -> EmbeddingService:
    """The embedding service of the running app."""
    return request.app.state.embeddings


async def answered(request: Request, work: Awaitable[T]) -> T:
    """work's result, cancelled if the client leaves first; an engine failure is a 500."""
    try:
        return await cancel_on_disconnect(request, work)
    except EngineError as exc:
        raise APIError(str(exc), status=500, type="server_error") from exc


@router.post("/v1/embeddings", tags=["openai"])
async def create_embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    """Embeddings of a text, texts, token ids or lists of token ids."""
    return await answered(request, embedding_service(request).embed(body))


@router.post("/v1/rerank", tags=["embeddings"])
async def rerank(body: RerankRequest, request: Request) -> RerankResponse:
    """Documents ranked by relevance to a query, by a reranker (cross-encoder) or an embedding model."""
    return await answered(request, embedding_service(request).rerank(body))


@router.post("/v1/score", tags=["embeddings"])
async def score(body: ScoreRequest, request: Request) -> ScoreResponse:
    """Relevance scores of text pairs."""
    return await answered(request, embedding_service(request).score(body))
