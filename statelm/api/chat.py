"""/v1/chat/completions: validate, render the conversation, generate, and shape the response."""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from statelm.api.errors import APIError
from statelm.api.generation import TextDelta, collect
from statelm.api.limits import GenerationLimits
from statelm.api.logprobs import chat_logprobs
from statelm.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChunkChoice,
    DeltaMessage,
    Timings,
    Usage,
)
from statelm.api.serving import (
    ServedModel,
    ServingContext,
    sampling_defaults,
    stream_events,
    timings_of,
    usage_of,
)
from statelm.engine.async_engine import AsyncEngine
from statelm.metrics import ServingMetrics
from statelm.sessions.manager import SessionManager
from statelm.sessions.session import Session
from statelm.tokenizer import Tokenizer


def transcript_for_template(transcript: list[dict[str, Any]]) -> list[dict[str, str]]:
    """A session's messages as the chat template takes them; 422 if a stored message is malformed."""
    try:
        return [ChatMessage.model_validate(message).for_template() for message in transcript]
    except ValidationError as exc:
        raise APIError(f"the session's transcript holds an invalid message: {exc}", status=422) from exc


class ChatService:
    """Serves chat completions from the engine, stateless or as turns of a session.

    Its `context` (engine, tokenizer, model, limits, sampling defaults) serves the other endpoints as well.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Tokenizer,
        model: ServedModel,
        metrics: ServingMetrics,
        sessions: SessionManager | None = None,
        limits: GenerationLimits | None = None,
    ) -> None:
        defaults = sampling_defaults(engine.engine.sampling_defaults)
        self.context = ServingContext(engine, tokenizer, model, metrics, limits, defaults)
        self.sessions = sessions

    async def complete(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        """Generate every choice in full."""
        request_id, deltas = await self._start(request)
        choices, stats = await collect(deltas, request.n)
        strings = self.context.strings
        return ChatCompletionResponse(
            id=request_id,
            created=int(time.time()),
            model=request.model,
            choices=[
                ChatChoice(
                    index=index,
                    message=AssistantMessage(content=choice.text),
                    finish_reason=choice.finish_reason,
                    logprobs=chat_logprobs(choice.tokens, strings) if request.logprobs else None,
                )
                for index, choice in enumerate(choices)
            ],
            usage=usage_of(stats),
            timings=timings_of(stats),
            session_id=request.session_id,
        )

    async def stream(self, request: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Generate the choices as chunks; validation errors are raised before the first chunk."""
        request_id, deltas = await self._start(request)
        return self._chunks(request, request_id, deltas)

    async def _chunks(
        self, request: ChatCompletionRequest, request_id: str, deltas: AsyncIterator[TextDelta]
    ) -> AsyncIterator[ChatCompletionChunk]:
        created = int(time.time())

        def chunk(
            choices: list[ChunkChoice], usage: Usage | None = None, timings: Timings | None = None
        ) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=request_id,
                created=created,
                model=request.model,
                choices=choices,
                usage=usage,
                timings=timings,
                session_id=request.session_id,
            )

        for index in range(request.n):
            yield chunk([ChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for event in stream_events(deltas, request.include_usage()):
            delta = event.delta
            if delta is None:
                yield chunk([], usage=event.usage, timings=event.timings)
            elif event.finish:
                finish = ChunkChoice(index=delta.index, delta=DeltaMessage(), finish_reason=delta.finish_reason)
                yield chunk([finish], timings=event.timings)
            else:
                logprobs = chat_logprobs(delta.tokens, self.context.strings) if request.logprobs else None
                yield chunk([ChunkChoice(index=delta.index, delta=DeltaMessage(content=delta.text), logprobs=logprobs)])

    async def _start(self, request: ChatCompletionRequest) -> tuple[str, AsyncIterator[TextDelta]]:
        """Validate and render the request; return its id and its (not yet started) generation."""
        self.context.admit(request.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if request.session_id is not None:
            return request_id, await self._start_turn(request, request_id)
        prompt_ids = self.context.render_chat([m.for_template() for m in request.messages], {})
        params = self.context.sampling_params(request, len(prompt_ids), self.context.model.max_model_len, "messages")
        return request_id, self.context.generate(request_id, prompt_ids, params, request.stop_strings())

    async def _start_turn(self, request: ChatCompletionRequest, request_id: str) -> AsyncIterator[TextDelta]:
        """Begin a session turn: the session's transcript plus this turn's messages, from the session's KV."""
        if self.sessions is None:
            raise APIError("sessions are not enabled on this server", param="session_id")
        if request.n != 1:
            raise APIError("a session turn has one reply: n must be 1 with session_id", param="n")
        session = self.sessions.begin_turn(request.session_id or "")
        turn = SessionTurn(self.sessions, session, request_id)
        try:
            new_messages = [message.for_transcript() for message in request.messages]
            prompt_ids = self.context.render_chat(
                transcript_for_template(session.transcript + new_messages), session.settings.chat_template_kwargs
            )
            max_model_len = self.context.model.max_model_len
            context = min(max_model_len, session.settings.max_tokens or max_model_len)
            params = self.context.sampling_params(request, len(prompt_ids), context, "messages")
            restore = await self.sessions.kv_to_restore(session)
        except BaseException:
            turn.end(None)
            raise
        deltas = self.context.generate(
            request_id, prompt_ids, params, request.stop_strings(), session_id=session.id, restore=restore
        )
        return turn.follow(deltas, new_messages)


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

    def follow(self, deltas: AsyncIterator[TextDelta], new_messages: list[dict[str, Any]]) -> AsyncIterator[TextDelta]:
        """deltas, committing the turn at the final one; a generation dropped before that drops the turn."""

        async def committed() -> AsyncIterator[TextDelta]:
            text: list[str] = []
            try:
                async for delta in deltas:
                    text.append(delta.text)
                    if delta.finish_reason is not None:
                        self.end([*new_messages, {"role": "assistant", "content": "".join(text)}])
                    yield delta
            finally:
                self.end(None)

        stream = committed()
        weakref.finalize(stream, self.end, None)  # a stream that is never iterated still frees the session
        return stream
