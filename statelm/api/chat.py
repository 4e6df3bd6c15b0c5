"""/v1/chat/completions: validate, render the conversation, generate, and shape the response."""

from __future__ import annotations

import dataclasses
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from statelm.api.access_log import log_request
from statelm.api.chat_output import ChoiceEvent, ChoiceMessage, chat_events, collect_choices
from statelm.api.chat_prompt import RenderedPrompt, forces_tool_call
from statelm.api.errors import APIError
from statelm.api.generation import GenerationStats
from statelm.api.limits import GenerationLimits
from statelm.api.logprobs import chat_logprobs
from statelm.api.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChunkChoice,
    DeltaMessage,
    NamedToolChoice,
    StoredChatCompletion,
    Timings,
    Usage,
)
from statelm.api.serving import (
    ServedModel,
    ServingContext,
    sampling_defaults,
    served_tier,
    timings_of,
    usage_of,
)
from statelm.api.stored_completions import CompletionStore
from statelm.api.structured_output import forced_tool_constraint
from statelm.engine.async_engine import AsyncEngine
from statelm.engine.sequence import SamplingParams
from statelm.metrics import ServingMetrics
from statelm.sessions.manager import SessionManager
from statelm.sessions.ownership import current_principal
from statelm.sessions.session import Session
from statelm.tokenizer import Tokenizer


def stored_messages(transcript: list[dict[str, Any]]) -> list[ChatMessage]:
    """A session's messages as request messages; 422 if a stored message is malformed."""
    try:
        return [ChatMessage.model_validate(message) for message in transcript]
    except ValidationError as exc:
        raise APIError(f"the session's transcript holds an invalid message: {exc}", status=422) from exc


class ChatService:
    """Serves chat completions from the engine, stateless or as turns of a session.

    Its `context` (engine, tokenizer, model, limits, sampling defaults, chat format) serves the other
    endpoints as well.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Tokenizer,
        model: ServedModel,
        metrics: ServingMetrics,
        sessions: SessionManager | None = None,
        limits: GenerationLimits | None = None,
        *,
        tool_parser: str | None = None,
        reasoning_parser: str = "auto",
        completions: CompletionStore | None = None,
    ) -> None:
        defaults = sampling_defaults(engine.engine.sampling_defaults)
        self.context = ServingContext(
            engine,
            tokenizer,
            model,
            metrics,
            limits,
            defaults,
            tool_parser=tool_parser,
            reasoning_parser=reasoning_parser,
        )
        self.sessions = sessions
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
        self.context.admit(request.model)
        if request.store:
            self.completions.check_enabled()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        log_request(request_id, request)
        if request.session_id is not None:
            return request_id, await self._start_turn(request, request_id)
        prompter = self.context.prompter
        prompt = await self.context.render(request.messages, request.tools, prompter.template_kwargs(request, {}))
        params = await self._params(request, prompt, self.context.model.max_model_len)
        parsers = prompter.output_parsers(request, prompt)
        deltas = self.context.generate(
            request_id, prompt.ids, params, request.stop_strings(), keep_special_tokens=prompter.keep_special_tokens
        )
        return request_id, chat_events(deltas, parsers)

    async def _start_turn(self, request: ChatCompletionRequest, request_id: str) -> AsyncIterator[ChoiceEvent]:
        """Begin a session turn: the session's transcript plus this turn's messages, from the session's KV."""
        if self.sessions is None:
            raise APIError("sessions are not enabled on this server", param="session_id")
        if request.n != 1:
            raise APIError("a session turn has one reply: n must be 1 with session_id", param="n")
        session = self.sessions.begin_turn(request.session_id or "")
        turn = SessionTurn(self.sessions, session, request_id)
        prompter = self.context.prompter
        try:
            new_messages = [message.for_transcript() for message in request.messages]
            kwargs = prompter.template_kwargs(request, session.settings.chat_template_kwargs)
            max_model_len = self.context.model.max_model_len
            context = min(max_model_len, session.settings.max_tokens or max_model_len)
            messages = stored_messages(session.transcript) + request.messages
            prompt = await self.context.render(messages, request.tools, kwargs, context=context)
            params = await self._params(request, prompt, context)
            parsers = prompter.output_parsers(request, prompt)
            restore = await self.sessions.kv_to_restore(session)
        except BaseException:
            turn.end(None)
            raise
        deltas = self.context.generate(
            request_id,
            prompt.ids,
            params,
            request.stop_strings(),
            session_id=session.id,
            restore=restore,
            keep_special_tokens=prompter.keep_special_tokens,
        )
        return turn.follow(chat_events(deltas, parsers), new_messages)

    async def _params(self, request: ChatCompletionRequest, prompt: RenderedPrompt, context: int) -> SamplingParams:
        """Sampling parameters with the request's constraint, forced tool call and reasoning budget."""
        prompter = self.context.prompter
        params = self.context.sampling_params(request, len(prompt.ids), context, "messages")
        forced = None
        if forces_tool_call(request):
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()]
            choice = request.tool_choice
            named = choice.model_dump() if isinstance(choice, NamedToolChoice) else "required"
            forced = forced_tool_constraint(tools, named, request.parallel_tool_calls)
        params = await self.context.constrained(request, params, forced, prompter.reasoning_end_ids(prompt))
        budget = prompter.reasoning_budget(request, prompt)
        return params if budget is None else dataclasses.replace(params, reasoning=budget)


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

    def follow(
        self, events: AsyncIterator[ChoiceEvent], new_messages: list[dict[str, Any]]
    ) -> AsyncIterator[ChoiceEvent]:
        """events, committing the turn (the reply with its reasoning and tool calls) at the final one.

        A generation dropped before that drops the turn. The template decides whether later prompts show
        the reasoning; the session's cache follows whatever it renders (longest common prefix).
        """

        async def committed() -> AsyncIterator[ChoiceEvent]:
            reply = ChoiceMessage()
            try:
                async for event in events:
                    reply.add(event)
                    if event.finish_reason is not None:
                        message = reply.message().model_dump(exclude_none=True)
                        self.end([*new_messages, message])
                        await self.sessions.settled(self.session)  # the client sees the end once it is durable
                    yield event
            finally:
                self.end(None)

        stream = committed()
        weakref.finalize(stream, self.end, None)  # a stream that is never iterated still frees the session
        return stream
