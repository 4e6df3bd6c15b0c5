"""The embedding routes' work: inputs tokenized and checked, run by the model the request names, answered."""

from __future__ import annotations

import asyncio
import time
import uuid

import torch
import torch.nn.functional as F

from statelm.api.access_log import log_request
from statelm.api.embeddings.models import EmbeddingModel, EmbeddingModels, EncoderInput
from statelm.api.embeddings.protocol import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    Score,
    ScoreRequest,
    ScoreResponse,
)
from statelm.api.embeddings.vectors import check_dimensions, encoded, shortened
from statelm.api.errors import APIError
from statelm.api.limits import GenerationLimits
from statelm.metrics import ServingMetrics


class EmbeddingService:
    """Embeds, reranks and scores with the served embedding models."""

    def __init__(
        self, models: EmbeddingModels, metrics: ServingMetrics | None = None, limits: GenerationLimits | None = None
    ) -> None:
        self.models = models
        self.metrics = metrics
        self.limits = limits  # its max_prompt_tokens caps each input

    def close(self) -> None:
        """Stop the runners of the models this service owns (encoders; the decoder's engine is the app's)."""
        for model in self.models.models:
            model.runner.close()

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """OpenAI's embeddings of every input, in order."""
        model = self.models.find(request.model, scores=False)
        check_dimensions(request.dimensions, model.dimensions, model.matryoshka, request.model)
        model.admit()
        request_id = f"embd-{uuid.uuid4().hex}"
        log_request(request_id, request)  # type: ignore[arg-type]  # it reads the tags a request has
        inputs = request.inputs()
        if isinstance(inputs[0], str):
            prompts = await self._tokenize(model, inputs, "input")  # type: ignore[arg-type]
        else:
            prompts = [self._checked_ids(model, ids, "input") for ids in inputs]  # type: ignore[arg-type]
        vectors = await self._run(model, request_id, [EncoderInput(ids) for ids in prompts])
        data = [
            Embedding(index=i, embedding=encoded(shortened(vector, request.dimensions), request.encoding_format))
            for i, vector in enumerate(vectors)
        ]
        tokens = sum(map(len, prompts))
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        fingerprint = model.served.system_fingerprint
        return EmbeddingResponse(data=data, model=request.model, usage=usage, system_fingerprint=fingerprint)

    async def rerank(self, request: RerankRequest) -> RerankResponse:
        """The documents by relevance to the query, the most relevant first, `top_n` of them."""
        model = self.models.find(request.model, scores=True)
        model.admit()
        request_id = f"rerank-{uuid.uuid4().hex}"
        texts = request.texts()
        scores, tokens = await self._scores(model, request_id, [(request.query, text) for text in texts], "documents")
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[: request.top_n or None]
        results = [
            RerankResult(
                index=i,
                relevance_score=scores[i],
                document=RerankDocument(text=texts[i]) if request.return_documents else None,
            )
            for i in order
        ]
        usage = RerankUsage(prompt_tokens=tokens, total_tokens=tokens)
        return RerankResponse(id=request_id, model=request.model, results=results, usage=usage)

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        """Each pair's score: a cross-encoder's relevance, or an embedding model's cosine similarity."""
        model = self.models.find(request.model, scores=True)
        pairs = request.pairs()
        model.admit()
        request_id = f"score-{uuid.uuid4().hex}"
        scores, tokens = await self._scores(model, request_id, pairs, "text_2")
        return ScoreResponse(
            id=request_id,
            created=int(time.time()),
            model=request.model,
            data=[Score(index=i, score=score) for i, score in enumerate(scores)],
            usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
        )

    async def _scores(
        self, model: EmbeddingModel, request_id: str, pairs: list[tuple[str, str]], param: str
    ) -> tuple[list[float], int]:
        """Each pair's score and the tokens read: a cross-encoder runs every pair together (sigmoid of its logit);
        an embedding model embeds each distinct text once and compares the vectors by cosine."""
        if model.cross_encoder:
            inputs = await asyncio.to_thread(lambda: [model.encode_pair(first, second) for first, second in pairs])
            for item in inputs:
                self._check_length(model, len(item.ids), param)
            logits = await self._run(model, request_id, inputs)
            return [torch.sigmoid(logit[0]).item() for logit in logits], sum(len(item.ids) for item in inputs)
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        prompts = await self._tokenize(model, texts, param)
        embedded = await self._run(model, request_id, [EncoderInput(ids) for ids in prompts])
        vectors = dict(zip(texts, embedded, strict=True))
        scores = [F.cosine_similarity(vectors[first], vectors[second], dim=0).item() for first, second in pairs]
        return scores, sum(map(len, prompts))

    async def _tokenize(self, model: EmbeddingModel, texts: list[str], param: str) -> list[list[int]]:
        """The texts' token ids with the model's special tokens, tokenized in a worker thread; checked for length."""
        prompts = await asyncio.to_thread(lambda: [model.encode(text) for text in texts])
        for ids in prompts:
            self._check_length(model, len(ids), param)
        return prompts

    def _checked_ids(self, model: EmbeddingModel, ids: list[int], param: str) -> list[int]:
        """Token ids as sent, 400 if one is outside the vocabulary or there are too many."""
        vocab = model.tokenizer.vocab_size
        outside = [token_id for token_id in ids if token_id >= vocab]
        if outside:
            raise APIError(f"token id {outside[0]} in {param} is outside the vocabulary (0..{vocab - 1})", param=param)
        self._check_length(model, len(ids), param)
        return ids

    def _check_length(self, model: EmbeddingModel, num_tokens: int, param: str) -> None:
        """400 for an input longer than the model's context or the server's prompt cap."""
        context = model.served.max_model_len
        if num_tokens > context:
            raise APIError(
                f"This model's maximum context length is {context} tokens; an input has {num_tokens} tokens, which"
                " does not fit.",
                param=param,
                code="context_length_exceeded",
            )
        if self.limits is not None:
            self.limits.check_prompt(num_tokens, param)

    async def _run(self, model: EmbeddingModel, request_id: str, inputs: list[EncoderInput]) -> list[torch.Tensor]:
        """The runner's vectors, counted in the prompt-token metric."""
        vectors = await model.runner.run(request_id, inputs)
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum(len(item.ids) for item in inputs))
        return vectors
