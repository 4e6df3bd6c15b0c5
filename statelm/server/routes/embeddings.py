"""The embedding routes: OpenAI's /v1/embeddings, and /v1/rerank and /v1/score as vLLM and llama.cpp serve them."""

from __future__ import annotations

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
from statelm.server.routes.openai import cancel_on_disconnect

router = APIRouter()


def embedding_service(request: Request) -> EmbeddingService:
    """The embedding service of the running app."""
    return request.app.state.embeddings


@router.post("/v1/embeddings", tags=["openai"])
async def create_embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    """Embeddings of a text, texts, token ids or lists of token ids."""
    return await cancel_on_disconnect(request, embedding_service(request).embed(body))


@router.post("/v1/rerank", tags=["embeddings"])
async def rerank(body: RerankRequest, request: Request) -> RerankResponse:
    """Documents ranked by relevance to a query, by a reranker (cross-encoder) or an embedding model."""
    return await cancel_on_disconnect(request, embedding_service(request).rerank(body))


@router.post("/v1/score", tags=["embeddings"])
async def score(body: ScoreRequest, request: Request) -> ScoreResponse:
    """Relevance scores of text pairs."""
    return await cancel_on_disconnect(request, embedding_service(request).score(body))
