"""/v1/chat/completions: validate, render the conversation, generate, and shape the response."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from statelm.api.chat_output import ChoiceEvent, ChoiceMessage, collect_choices
from statelm.api.conversation import ConversationService, TurnPlan
from statelm.api.errors import APIError
from statelm.api.generation import GenerationStats
from statelm.api.logprobs import chat_logprobs
from statelm.api.openai.stored_completions import CompletionStore
from statelm.api.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChunkChoice,
    DeltaMessage,
    StoredChatCompletion,
    Timings,
    Usage,
)
from statelm.api.serving import served_tier, timings_of, usage_of
from statelm.sessions.ownership import current_principal


class ChatService:
    """Serves chat completions from the conversation core, stateless or as turns of a session."""

    def __init__(self, conversations: ConversationService, completions: CompletionStore | None = None) -> None:
        self.conversations = conversations
        self.context = conversations.context
        self.completions = completions or CompletionStore(0)  # what `store: true` keeps; none by default

    async def complete(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        """Generate every choice in full."""
        owner = current_principal().owner
        request_id, events = await self._start(request)
        choices, stats = await collect_choices(events, request.n)
        response = self._response(request, request_id, int(time.time()), choices, stats)
        self._keep(request, owner, response)
        return response

    def _response(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        choices: list[ChoiceMessage],
        stats: GenerationStats,
    ) -> ChatCompletionResponse:
        """The whole response of finished choices."""
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=request.model,
            choices=[
                ChatChoice(
                    index=index,
                    message=choice.message(),
                    finish_reason=choice.finish_reason,
                    logprobs=chat_logprobs(choice.tokens, self.context.strings) if request.logprobs else None,
                    repetition_detected=choice.repetition_detected or None,
                )
                for index, choice in enumerate(choices)
            ],
            usage=usage_of(stats),
            timings=timings_of(stats),
            system_fingerprint=self.context.model.system_fingerprint,
            service_tier=served_tier(request),
            session_id=request.session_id,
        )

    def _keep(self, request: ChatCompletionRequest, owner: str, response: ChatCompletionResponse) -> None:
        """Store the response, with the request's metadata, when the request asks for it."""
        if request.store:
            stored = {**response.model_dump(), "metadata": request.metadata or {}}
            self.completions.put(owner, StoredChatCompletion.model_validate(stored))

    async def stream(self, request: ChatCompletionRequest) -> AsyncIterator[ChatCompletionChunk]:
        """Generate the choices as chunks; validation errors are raised before the first chunk."""
        owner = current_principal().owner
        request_id, events = await self._start(request)
        return self._chunks(request, request_id, events, owner)

    async def _chunks(
        self, request: ChatCompletionRequest, request_id: str, events: AsyncIterator[ChoiceEvent], owner: str
    ) -> AsyncIterator[ChatCompletionChunk]:
        """OpenAI's order: a role chunk per choice, deltas, a finish chunk per choice, then usage if asked for.

        A stored stream is kept, as the whole response, once its last choice has finished.
        """
        created = int(time.time())
        gathered = [ChoiceMessage() for _ in range(request.n)] if request.store else None

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
                system_fingerprint=self.context.model.system_fingerprint,
                service_tier=served_tier(request),
                session_id=request.session_id,
            )

        for index in range(request.n):
            yield chunk([ChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for event in events:
            if gathered is not None:
                gathered[event.index].add(event)
                if event.stats is not None:
                    self._keep(request, owner, self._response(request, request_id, created, gathered, event.stats))
            piece = event.piece
            if piece or event.tokens:
                delta = DeltaMessage(
                    content=piece.content if piece.content or not (piece.reasoning or piece.tool_calls) else None,
                    reasoning_content=piece.reasoning or None,
                    tool_calls=piece.tool_calls or None,
                )
                logprobs = chat_logprobs(event.tokens, self.context.strings) if request.logprobs else None
                yield chunk([ChunkChoice(index=event.index, delta=delta, logprobs=logprobs)])
            stats = event.stats
            if event.finish_reason is not None:
                finish = ChunkChoice(
                    index=event.index,
                    delta=DeltaMessage(),
                    finish_reason=event.finish_reason,
                    repetition_detected=event.repetition_detected or None,
                )
                last = stats is not None and not request.include_usage()
                yield chunk([finish], timings=timings_of(stats) if last and stats is not None else None)
            if stats is not None and request.include_usage():
                yield chunk([], usage=usage_of(stats), timings=timings_of(stats))

    async def _start(self, request: ChatCompletionRequest) -> tuple[str, AsyncIterator[ChoiceEvent]]:
        """Validate and render the request; return its id and its (not yet started) generation."""
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.conversations.admit(request, request_id)
        if request.store:
            self.completions.check_enabled()
        if request.session_id is None:
            return request_id, await self.conversations.generate(request, request_id, request.messages)
        if request.n != 1:
            raise APIError("a session turn has one reply: n must be 1 with session_id", param="n")
        session = self.conversations.manager().begin_turn(request.session_id)
        plan = TurnPlan(source=session, history=session.transcript, target=session)
        return request_id, await self.conversations.turn(request, request_id, plan, request.messages)
