"""The conversation core: a chat request rendered, admitted and generated, statelessly or as a turn of a session.

Chat completions and responses both serve from it; each wire protocol translates its request into a
`ChatCompletionRequest` and the events below into its own objects. A session turn renders its history and new
messages, starts from the KV of the session it reads (longest common prefix) and, when its final event arrives and
before that event is passed on, commits into its target session and waits until that session's changes are durable
(its journal records written and fsynced, under `--session-durability turn`), so a client never sees a turn end that
a crash could lose; a turn dropped before that (an error, a client gone, a stream closed) commits nothing, and one
whose record cannot be written (a full disk) is taken back and ends in StorageError instead of its final event.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from statelm.api.access_log import log_request
from statelm.api.chat_output import ChoiceEvent, ChoiceMessage, chat_events
from statelm.api.chat_prompt import RenderedPrompt, forces_tool_call
from statelm.api.errors import APIError
from statelm.api.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from statelm.api.serving import ServingContext
from statelm.api.structured_output import forced_tool_constraint
from statelm.engine.client import CachePinRequest, SamplingParams
from statelm.sessions.manager import SessionManager
from statelm.sessions.session import Session, SessionKind, SessionSettings


def stored_messages(transcript: Sequence[dict[str, Any]]) -> list[ChatMessage]:
    """A session's messages as request messages; 422 if a stored message is malformed."""
    try:
        return [ChatMessage.model_validate(message) for message in transcript]
    except ValidationError as exc:
        raise APIError(f"the session's transcript holds an invalid message: {exc}", status=422) from exc


@dataclass(frozen=True)
class TurnPlan:
    """Where a session turn starts from and where it commits.

    Its prompt is the history and the new messages, from `source`'s KV; it commits into `target`, which the caller
    has marked busy. The two are the same session for a plain turn; a branch reads one session and commits into a
    `fresh` one (made for the turn: it takes the history as well, and is removed if the turn is dropped).
    """

    source: Session | None  # whose KV the prompt starts from (None: the prefix cache only)
    history: list[dict[str, Any]]  # the transcript messages before this turn's
    target: Session | None  # None: the turn commits nothing (its KV is dropped at the end)
    fresh: bool = False

    @property
    def settings(self) -> SessionSettings:
        """The session settings the turn runs with (its context cap, its template variables)."""
        session = self.source or self.target
        return session.settings if session is not None else SessionSettings()


class ConversationTurn:
    """One running turn: commits its messages and KV when it completes, drops them otherwise."""

    def __init__(self, sessions: SessionManager, plan: TurnPlan, request_id: str) -> None:
        self.sessions = sessions
        self.plan = plan
        self.request_id = request_id
        self.ended = False

    def end(self, messages: list[dict[str, Any]] | None) -> None:
        """Commit messages (None: drop the turn); only the first call counts."""
        if self.ended:
            return
        self.ended = True
        target = self.plan.target
        self.sessions.end_turn(target, self.request_id, messages)
        if messages is None and self.plan.fresh and target is not None:
            self.sessions.forget_unused(target)

    def follow(
        self,
        events: AsyncIterator[ChoiceEvent],
        new_messages: list[dict[str, Any]],
        on_commit: Callable[[ChoiceEvent], None] | None = None,
    ) -> AsyncIterator[ChoiceEvent]:
        """events, committing the turn (the reply with its reasoning and tool calls) at the final one, before it.

        At the final event the turn commits into the plan's target, on_commit (what the caller keeps with the turn,
        such as a stored response) runs with that event in the same step, and the event is passed on once the
        target's changes are durable. A generation dropped before that drops the turn. The template decides whether
        later prompts show the reasoning; the session's cache follows whatever it renders (longest common prefix).
        """
        plan = self.plan
        target = plan.target
        kept_as_response = target is not None and target.kind is SessionKind.RESPONSES
        what = "the response" if kept_as_response else f"the turn of session {target.id if target else None!r}"

        async def committed() -> AsyncIterator[ChoiceEvent]:
            reply = ChoiceMessage()
            try:
                async for event in events:
                    reply.add(event)
                    if event.finish_reason is not None and plan.target is not None:
                        message = reply.message().model_dump(exclude_none=True)
                        self.end([*(plan.history if plan.fresh else ()), *new_messages, message])
                        if on_commit is not None:
                            on_commit(event)
                        await self.sessions.settled(plan.target, what)  # the client sees the end once it is durable
                    yield event
            finally:
                self.end(None)

        stream = committed()
        weakref.finalize(stream, self.end, None)  # a stream that is never iterated still frees the session
        return stream


class ConversationService:
    """Renders, admits and generates chat requests, statelessly or as session turns."""

    def __init__(self, context: ServingContext, sessions: SessionManager | None) -> None:
        self.context = context
        self.sessions = sessions

    def manager(self) -> SessionManager:
        """The server's sessions; 400 naming session_id on a server without them."""
        if self.sessions is None:
            raise APIError("sessions are not enabled on this server", param="session_id")
        return self.sessions

    def admit(self, request: ChatCompletionRequest, request_id: str) -> None:
        """404 for another model, 429 when the queue is full; then the request's access log line."""
        self.context.admit(request.model)
        log_request(request_id, request)

    async def generate(
        self, request: ChatCompletionRequest, request_id: str, messages: list[ChatMessage], prefill: str = ""
    ) -> AsyncIterator[ChoiceEvent]:
        """The (not yet started) generation of a reply to messages, continuing `prefill`, without a session."""
        prompt = await self.prompt(request, messages, prefill)
        return await self.generate_prompt(request, request_id, prompt)

    async def prompt(
        self, request: ChatCompletionRequest, messages: list[ChatMessage], prefill: str = ""
    ) -> RenderedPrompt:
        """The prompt of a reply to messages (continuing `prefill`), without a session."""
        kwargs = self.context.prompter.template_kwargs(request, {})
        return await self.context.render(messages, request.tools, kwargs, prefill=prefill)

    async def generate_prompt(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        prompt: RenderedPrompt,
        cache_pins: tuple[CachePinRequest, ...] = (),
    ) -> AsyncIterator[ChoiceEvent]:
        """The (not yet started) generation of a reply to a rendered prompt, without a session, pinning the prompt
        prefixes of cache_pins in the prefix cache."""
        prompter = self.context.prompter
        params = await self.params(request, prompt, self.context.model.max_model_len)
        params = dataclasses.replace(params, cache_pins=cache_pins)
        parsers = prompter.output_parsers(request, prompt)
        deltas = self.context.generate(
            request_id, prompt.ids, params, request.stop_strings(), keep_special_tokens=prompter.keep_special_tokens
        )
        return chat_events(deltas, parsers)

    async def turn(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        plan: TurnPlan,
        new_messages: list[ChatMessage],
        *,
        preamble: Sequence[ChatMessage] = (),
        on_commit: Callable[[ChoiceEvent], None] | None = None,
    ) -> AsyncIterator[ChoiceEvent]:
        """The (not yet started) turn of plan: preamble (rendered, never kept), history and new messages.

        The plan's target is ended whatever happens: committed by the final event (on_commit then runs with it,
        before the wait for durability; see `ConversationTurn.follow`), dropped on any failure.
        """
        sessions = self.manager()
        turn = ConversationTurn(sessions, plan, request_id)
        prompter = self.context.prompter
        try:
            settings = plan.settings
            kwargs = prompter.template_kwargs(request, settings.chat_template_kwargs)
            max_model_len = self.context.model.max_model_len
            context = min(max_model_len, settings.max_tokens or max_model_len)
            messages = [*preamble, *stored_messages(plan.history), *new_messages]
            prompt = await self.context.render(messages, request.tools, kwargs, context=context)
            params = await self.params(request, prompt, context)
            parsers = prompter.output_parsers(request, prompt)
            source = plan.source or plan.target
            restore = await sessions.kv_to_restore(plan.source) if plan.source is not None else None
        except BaseException:
            turn.end(None)
            raise
        deltas = self.context.generate(
            request_id,
            prompt.ids,
            params,
            request.stop_strings(),
            session_id=source.id if source is not None else None,
            restore=restore,
            keep_special_tokens=prompter.keep_special_tokens,
        )
        new = [message.for_transcript() for message in new_messages]
        return turn.follow(chat_events(deltas, parsers), new, on_commit)

    async def params(self, request: ChatCompletionRequest, prompt: RenderedPrompt, context: int) -> SamplingParams:
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
