"""/v1/chat/completions: validate, render the conversation, generate, and shape the response."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from statelm.api.errors import APIError
from statelm.api.generation import TextChunk, generate_text
from statelm.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChunkChoice,
    DeltaMessage,
    PromptTokensDetails,
    Usage,
)
from statelm.engine.async_engine import AsyncEngine
from statelm.engine.sequence import SamplingParams
from statelm.metrics import ServingMetrics
from statelm.tokenizer import ChatTemplateError, Tokenizer


@dataclass
class ServedModel:
    """The model this server answers for, as the API sees it."""

    name: str
    aliases: frozenset[str]
    max_model_len: int
    created: int

    def check(self, requested: str) -> None:
        """404 unless the request names this model."""
        if requested != self.name and requested not in self.aliases:
            raise APIError(
                f"The model `{requested}` does not exist; this server serves `{self.name}`.",
                status=404,
                param="model",
                code="model_not_found",
            )


def usage_of(chunk: TextChunk) -> Usage:
    """Usage block from the final counts of a generation."""
    return Usage(
        prompt_tokens=chunk.prompt_tokens,
        completion_tokens=chunk.completion_tokens,
        total_tokens=chunk.prompt_tokens + chunk.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=chunk.cached_tokens),
    )


def sampling_params(
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    max_tokens: int | None,
    ignore_eos: bool,
    prompt_len: int,
    max_model_len: int,
) -> SamplingParams:
    """Engine parameters, after checking that prompt and completion fit the context."""
    room = max_model_len - prompt_len
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        wanted = f" plus max_tokens {max_tokens}" if max_tokens is not None else ""
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens{wanted}, which does not fit.",
            param="messages" if room <= 0 else "max_tokens",
            code="context_length_exceeded",
        )
    return SamplingParams(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=max(top_k or 0, 0),
        seed=seed,
        max_tokens=room if max_tokens is None else max_tokens,
        ignore_eos=ignore_eos,
    )


class ChatService:
    """Serves chat completions from the engine."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model: ServedModel, metrics: ServingMetrics) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.metrics = metrics

    async def complete(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        """Generate the whole reply."""
        request_id, pieces = self._start(request)
        text: list[str] = []
        async for chunk in pieces:
            text.append(chunk.text)
        return ChatCompletionResponse(
            id=request_id,
            created=int(time.time()),
            model=request.model,
            choices=[
                ChatChoice(
                    index=0,
                    message=AssistantMessage(content="".join(text)),
                    finish_reason=chunk.finish_reason,
                )
            ],
            usage=usage_of(chunk),
        )

    async def stream(self, request: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Generate the reply as chunks; validation errors are raised before the first chunk."""
        request_id, pieces = self._start(request)
        return self._chunks(request, request_id, pieces)

    async def _chunks(
        self, request: ChatCompletionRequest, request_id: str, pieces: AsyncIterator[TextChunk]
    ) -> AsyncIterator[ChatCompletionChunk]:
        created = int(time.time())

        def chunk(delta: DeltaMessage, finish: str | None = None) -> ChatCompletionChunk:
            choice = ChunkChoice(index=0, delta=delta, finish_reason=finish)
            return ChatCompletionChunk(id=request_id, created=created, model=request.model, choices=[choice])

        yield chunk(DeltaMessage(role="assistant", content=""))
        async for piece in pieces:
            if piece.text:
                yield chunk(DeltaMessage(content=piece.text))
            if piece.finish_reason is not None:
                yield chunk(DeltaMessage(), piece.finish_reason)
                if request.stream_options and request.stream_options.include_usage:
                    yield ChatCompletionChunk(
                        id=request_id, created=created, model=request.model, choices=[], usage=usage_of(piece)
                    )

    def _start(self, request: ChatCompletionRequest) -> tuple[str, AsyncIterator[TextChunk]]:
        """Validate and render the request; return its id and its (not yet started) text generation."""
        self.model.check(request.model)
        if self.engine.queue_is_full():
            raise APIError(
                f"The server is at capacity ({self.engine.max_queue} requests waiting); retry shortly.",
                status=429,
                type="rate_limit_error",
                code="queue_full",
            )
        try:
            prompt = self.tokenizer.apply_chat_template(
                [m.for_template() for m in request.messages], add_generation_prompt=True
            )
        except ChatTemplateError as exc:
            raise APIError(f"cannot render the conversation: {exc}", param="messages") from exc
        prompt_ids = self.tokenizer.encode(prompt)
        params = sampling_params(
            request.temperature,
            request.top_p,
            request.top_k,
            request.seed,
            request.requested_max_tokens(),
            request.ignore_eos,
            len(prompt_ids),
            self.model.max_model_len,
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stops = request.stop_strings()
        return request_id, generate_text(
            self.engine, self.tokenizer, request_id, prompt_ids, params, stops, self.metrics
        )
