"""/v1/chat/completions: validate, render the conversation, generate, and shape the response."""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from statelm.api.errors import APIError
from statelm.api.generation import TextChunk, generate_text
from statelm.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChunkChoice,
    DeltaMessage,
    PromptTokensDetails,
    Usage,
)
from statelm.engine.async_engine import AsyncEngine
from statelm.engine.sequence import SamplingParams
from statelm.metrics import ServingMetrics
from statelm.sessions.manager import SessionManager
from statelm.sessions.session import Session
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


def transcript_for_template(transcript: list[dict[str, Any]]) -> list[dict[str, str]]:
    """A session's messages as the chat template takes them; 422 if a stored message is malformed."""
    try:
        return [ChatMessage.model_validate(message).for_template() for message in transcript]
    except ValidationError as exc:
        raise APIError(f"the session's transcript holds an invalid message: {exc}", status=422) from exc


class ChatService:
    """Serves chat completions from the engine, stateless or as turns of a session."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Tokenizer,
        model: ServedModel,
        metrics: ServingMetrics,
        sessions: SessionManager | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.metrics = metrics
        self.sessions = sessions

    async def complete(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        """Generate the whole reply."""
        request_id, pieces = await self._start(request)
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
            session_id=request.session_id,
        )

    async def stream(self, request: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Generate the reply as chunks; validation errors are raised before the first chunk."""
        request_id, pieces = await self._start(request)
        return self._chunks(request, request_id, pieces)

    async def _chunks(
        self, request: ChatCompletionRequest, request_id: str, pieces: AsyncIterator[TextChunk]
    ) -> AsyncIterator[ChatCompletionChunk]:
        created = int(time.time())

        def chunk(delta: DeltaMessage, finish: str | None = None) -> ChatCompletionChunk:
            choice = ChunkChoice(index=0, delta=delta, finish_reason=finish)
            return ChatCompletionChunk(
                id=request_id, created=created, model=request.model, choices=[choice], session_id=request.session_id
            )

        yield chunk(DeltaMessage(role="assistant", content=""))
        async for piece in pieces:
            if piece.text:
                yield chunk(DeltaMessage(content=piece.text))
            if piece.finish_reason is not None:
                yield chunk(DeltaMessage(), piece.finish_reason)
                if request.stream_options and request.stream_options.include_usage:
                    yield ChatCompletionChunk(
                        id=request_id,
                        created=created,
                        model=request.model,
                        choices=[],
                        usage=usage_of(piece),
                        session_id=request.session_id,
                    )

    async def _start(self, request: ChatCompletionRequest) -> tuple[str, AsyncIterator[TextChunk]]:
        """Validate and render the request; return its id and its (not yet started) text generation."""
        self.model.check(request.model)
        if self.engine.queue_is_full():
            raise APIError(
                f"The server is at capacity ({self.engine.max_queue} requests waiting); retry shortly.",
                status=429,
                type="rate_limit_error",
                code="queue_full",
            )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if request.session_id is not None:
            return request_id, await self._start_turn(request, request_id)
        prompt_ids = self._render([m.for_template() for m in request.messages], {})
        params = self._sampling_params(request, len(prompt_ids), self.model.max_model_len)
        pieces = generate_text(
            self.engine, self.tokenizer, request_id, prompt_ids, params, request.stop_strings(), self.metrics
        )
        return request_id, pieces

    async def _start_turn(self, request: ChatCompletionRequest, request_id: str) -> AsyncIterator[TextChunk]:
        """Begin a session turn: the session's transcript plus this turn's messages, from the session's KV."""
        if self.sessions is None:
            raise APIError("sessions are not enabled on this server", param="session_id")
        session = self.sessions.begin_turn(request.session_id or "")
        turn = SessionTurn(self.sessions, session, request_id)
        try:
            new_messages = [message.for_transcript() for message in request.messages]
            prompt_ids = self._render(
                transcript_for_template(session.transcript + new_messages), session.settings.chat_template_kwargs
            )
            context = min(self.model.max_model_len, session.settings.max_tokens or self.model.max_model_len)
            params = self._sampling_params(request, len(prompt_ids), context)
            restore = await self.sessions.kv_to_restore(session)
        except BaseException:
            turn.end(None)
            raise
        pieces = generate_text(
            self.engine,
            self.tokenizer,
            request_id,
            prompt_ids,
            params,
            request.stop_strings(),
            self.metrics,
            session_id=session.id,
            restore=restore,
        )
        return turn.follow(pieces, new_messages)

    def _render(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
        """Token ids of the conversation rendered by the chat template, ready for the assistant's reply."""
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        except ChatTemplateError as exc:
            raise APIError(f"cannot render the conversation: {exc}", param="messages") from exc
        return self.tokenizer.encode(prompt)

    def _sampling_params(self, request: ChatCompletionRequest, prompt_len: int, context: int) -> SamplingParams:
        return sampling_params(
            request.temperature,
            request.top_p,
            request.top_k,
            request.seed,
            request.requested_max_tokens(),
            request.ignore_eos,
            prompt_len,
            context,
        )


class SessionTurn:
    """One turn of a session: commits its messages and KV when it completes, drops them otherwise."""

    def __init__(self, sessions: SessionManager, session: Session, request_id: str) -> None:
        self.sessions = sessions
        self.session = session
        self.request_id = request_id
        self.ended = False

    def end(self, messages: list[dict[str, Any]] | None) -> None:
        """Commit messages (None: drop the turn); only the first call counts."""
        if not self.ended:
            self.ended = True
            self.sessions.end_turn(self.session, self.request_id, messages)

    def follow(self, pieces: AsyncIterator[TextChunk], new_messages: list[dict[str, Any]]) -> AsyncIterator[TextChunk]:
        """pieces, committing the turn at the final chunk; a generation dropped before that drops the turn."""

        async def committed() -> AsyncIterator[TextChunk]:
            text: list[str] = []
            try:
                async for piece in pieces:
                    text.append(piece.text)
                    if piece.finish_reason is not None:
                        self.end([*new_messages, {"role": "assistant", "content": "".join(text)}])
                    yield piece
            finally:
                self.end(None)

        stream = committed()
        weakref.finalize(stream, self.end, None)  # a stream that is never iterated still frees the session
        return stream
