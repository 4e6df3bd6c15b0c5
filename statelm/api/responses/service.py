"""/v1/responses served from resident KV: a stored response is the head of a response-chain session.

`previous_response_id` continues from its chain's KV by longest common prefix, as a session turn does:

- continuing a chain's latest response extends that session (a turn on it, committed into it);
- continuing an older one (a branch), or one whose chain is busy, reads the chain's KV and commits into a new
  chain session, which shares the prefix's KV blocks;
- `store: false` reads the chain's KV and commits nothing; without `previous_response_id` it is a plain
  generation, and with `store: true` a new chain.

Retention (count per key, age) and deletions drop records; a chain left without records is deleted and one whose
latest record went is cut back to the one before (its KV tail then goes at its next turn).

Every change of a chain is a journalled change of its session (statelm.sessions.journal_store): a response is stored
in the step its turn commits, and both are durable before the response's last event goes out, as a session turn is
(`ConversationTurn.follow`); a deletion is durable before it is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from statelm.api.chat_output import ChoiceEvent
from statelm.api.conversation import ConversationService, TurnPlan
from statelm.api.errors import APIError
from statelm.api.generation import ReleasedToken
from statelm.api.logprobs import chat_logprobs
from statelm.api.protocol import ChatCompletionRequest, ChatMessage
from statelm.api.responses.chains import ResponseChains, ResponseRetention, StoredResponse, last_count, records
from statelm.api.responses.items import chat_messages, input_items, listed_items, new_id
from statelm.api.responses.objects import (
    DeletedResponse,
    InputItemList,
    ReasoningSettings,
    ResponseObject,
    TextSettings,
    output_logprobs,
)
from statelm.api.responses.output import Event, ResponseBuilder
from statelm.api.responses.protocol import ResponsesRequest, TextFormatText
from statelm.api.responses.translate import chat_request, responses_errors
from statelm.api.serving import effective_defaults, served_tier
from statelm.engine.client import EngineError
from statelm.sessions.errors import SessionLimitError
from statelm.sessions.ownership import LOCAL, acting_as, current_principal
from statelm.sessions.session import Session, SessionKind, SessionSettings
from statelm.sessions.storage import StorageError

CHAIN = SessionKind.RESPONSES


@dataclass
class ResponseRun:
    """A response being generated: its builder, and what keeps it once complete (store: true)."""

    builder: ResponseBuilder
    keep: Callable[[], None] | None = None
    _final: list[Event] | None = None  # the final event's stream events, made when its turn committed

    def commit(self, event: ChoiceEvent) -> None:
        """The final event, as its turn commits (ConversationTurn.follow): the response is finished and kept now.

        Kept in the step of the event loop the turn commits in, before the durability wait, so its record is
        journalled with the turn, no request sees the chain extended by a response not yet stored, and a client never
        sees a response complete that is not stored (durably).
        """
        self._final = self.builder.add(event)
        if self.keep is not None:
            self.keep()

    def add(self, event: ChoiceEvent) -> list[Event]:
        """The stream events of one generation event (of the final one: those made when its turn committed)."""
        final, self._final = self._final, None
        return final if final is not None else self.builder.add(event)


class ResponsesService:
    """Serves /v1/responses from the conversation core and the response chains."""

    def __init__(self, conversations: ConversationService, retention: ResponseRetention | None = None) -> None:
        self.conversations = conversations
        self.context = conversations.context
        self.chains = ResponseChains(retention or ResponseRetention(), conversations.sessions)
        self._deletions: dict[str, asyncio.Future[None]] = {}  # chains left empty being deleted, by session id

    async def start(self) -> None:
        """Index the chains resumed with the sessions, then apply the retention."""
        sessions = self.conversations.sessions
        if sessions is not None:
            self.chains.resume(session for session in sessions.sessions.values() if session.kind == CHAIN)
        await self.sweep()

    async def create(self, request: ResponsesRequest) -> ResponseObject:
        """Generate a whole response."""
        run, generation = await self._start(request)
        async for event in generation:
            run.add(event)
        return run.builder.response

    async def stream(self, request: ResponsesRequest) -> AsyncIterator[Event]:
        """The response's stream events; errors before the first one are raised, an engine failure ends it."""
        run, generation = await self._start(request)
        return self._events(run, generation)

    async def _events(self, run: ResponseRun, generation: AsyncIterator[ChoiceEvent]) -> AsyncIterator[Event]:
        for event in run.builder.started():
            yield event
        try:
            async for generated in generation:
                for event in run.add(generated):
                    yield event
        except (EngineError, StorageError) as exc:  # StorageError: the response could not be stored, nor its turn
            for event in run.builder.failed(str(exc)):
                yield event

    def get(self, response_id: str) -> ResponseObject:
        """A stored response."""
        return ResponseObject.model_validate(self._stored(response_id).record["response"])

    async def delete(self, response_id: str) -> DeletedResponse:
        """Forget a stored response and free what only it held, answered once durable: the chain deleted if it held
        nothing else, else the record dropped and the chain cut back (StorageError if that cannot be saved: nothing
        changes)."""
        stored = self._stored(response_id)
        session, manager = stored.session, self.conversations.manager()
        durable = None
        if set(records(session)) == {response_id} and not session.busy:
            await manager.delete(session.id, CHAIN)  # the chain goes whole, or nothing does
            forgotten = self.chains.drop(response_id)
        else:
            forgotten = self.chains.drop(response_id)
            self._cut_back(session)
            durable = manager.settled(session, f"the deletion of response {response_id!r}")
        if forgotten is not None:
            await forgotten  # out of the key's count on every server
        if durable is not None:
            await durable
        return DeletedResponse(id=response_id)

    async def drop_stored(self, response_ids: list[str]) -> None:
        """Forget those stored responses, any key's, if held here (the retention counted over several servers)."""
        for response_id in response_ids:
            self.chains.drop(response_id)
        await self.sweep()  # and free what only they held

    def input_items(self, response_id: str, after: str | None, limit: int, order: str) -> InputItemList:
        """A page of a stored response's input items, in order (`asc`) or latest first (`desc`)."""
        items = list(self._stored(response_id).record["input_items"])
        if order == "desc":
            items.reverse()
        ids = [item["id"] for item in items]
        if after is not None:
            if after not in ids:
                raise APIError(f"No input item with id '{after}' in response '{response_id}'.", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return InputItemList(
            data=page,
            first_id=page[0]["id"] if page else None,
            last_id=page[-1]["id"] if page else None,
            has_more=len(items) > limit,
        )

    async def sweep(self) -> None:
        """Drop every key's responses past the retention, and free what only they held: done once every chain left
        empty is deleted, by this sweep or by one under way (a request at its key's session limit then finds the
        places they held free, rather than dropping a chain that still holds responses to make one)."""
        for response_id in self.chains.expired(time.time()):
            self.chains.drop(response_id)
        sessions = self.conversations.sessions
        if sessions is None:
            return
        for session in [session for session in sessions.sessions.values() if session.kind == CHAIN]:
            await self._tidy(session)
        while self._deletions:
            await asyncio.wait(list(self._deletions.values()))

    async def _tidy(self, session: Session) -> None:
        """Delete an idle chain without records; cut one back to its latest record (the KV follows at its next turn)."""
        manager = self.conversations.manager()
        if session.busy or manager.sessions.get(session.id) is not session:  # busy, or deleted meanwhile
            return
        with acting_as(LOCAL):  # the retention acts for every key
            if not records(session):
                await self._delete_empty(session)
            else:
                self._cut_back(session)

    async def _delete_empty(self, session: Session) -> None:
        """Delete a chain left without records (kept whole if that cannot be saved: the next sweep tries again),
        known meanwhile to the sweeps that wait for it."""
        deleted = self._deletions[session.id] = asyncio.get_running_loop().create_future()
        try:
            with contextlib.suppress(StorageError):
                await self.conversations.manager().delete(session.id, CHAIN)
        finally:
            del self._deletions[session.id]
            deleted.set_result(None)

    def _cut_back(self, session: Session) -> None:
        """Cut an idle chain back to its latest record (the KV follows at its next turn)."""
        kept = last_count(session)
        if not session.busy and len(session.transcript) > kept:
            with acting_as(LOCAL):
                self.conversations.manager().rollback(session.id, kept, CHAIN)

    async def _start(self, request: ResponsesRequest) -> tuple[ResponseRun, AsyncIterator[ChoiceEvent]]:
        """Validate, render and admit the request; the response's run and its generation, not yet started."""
        await self.sweep()
        response_id = new_id("resp")
        with responses_errors():
            items = input_items(request.input)
            messages = chat_messages(items)
            chat = chat_request(request, messages)
            self.conversations.admit(chat, response_id)
            previous_id = request.previous_response_id
            previous = self._stored(previous_id, "previous_response_id") if previous_id is not None else None
            preamble = [ChatMessage(role="system", content=request.instructions)] if request.instructions else []
            run = ResponseRun(
                ResponseBuilder(
                    self._skeleton(request, chat, response_id),
                    logprobs=self._logprobs if request.logprobs() else None,
                    obfuscate=request.stream and request.obfuscated(),
                )
            )
            plan = await self._plan(request.store, previous)  # the plan's target is ended by the turn below
            if plan is None:
                generation = await self.conversations.generate(chat, response_id, [*preamble, *messages])
            else:
                if plan.target is not None:
                    run.keep = functools.partial(self._keep, plan.target, run.builder, listed_items(items))
                generation = await self.conversations.turn(
                    chat, response_id, plan, messages, preamble=preamble, on_commit=run.commit
                )
        return run, generation

    async def _plan(self, store: bool, previous: StoredResponse | None) -> TurnPlan | None:
        """Where the response's turn reads and commits (None: a plain generation, with nothing to read or keep)."""
        manager = self.conversations.manager()
        if previous is None:
            return TurnPlan(source=None, history=[], target=await self._new_chain(None), fresh=True) if store else None
        chain, count = previous.session, previous.count
        history = chain.transcript[:count]
        if not store:
            return TurnPlan(source=chain, history=history, target=None)
        if not chain.busy and last_count(chain) == count:
            if len(chain.transcript) > count:  # what a response dropped meanwhile left after it goes
                manager.rollback(chain.id, count, CHAIN)
            manager.begin_turn(chain.id, CHAIN)
            return TurnPlan(source=chain, history=chain.transcript, target=chain)
        return TurnPlan(source=chain, history=history, target=await self._new_chain(chain), fresh=True)

    async def _new_chain(self, source: Session | None) -> Session:
        """A new chain session, busy for the turn that fills it.

        At the key's session limit its least recently used idle chain (not source) is dropped to make room.
        """
        manager = self.conversations.manager()
        try:
            session = await manager.create(None, SessionSettings(), kind=CHAIN)
        except SessionLimitError:
            owner = current_principal().owner
            chains = [
                session
                for session in manager.sessions.values()
                if session.kind == CHAIN and session.owner == owner and not session.busy and session is not source
            ]
            if not chains:
                raise
            oldest = min(chains, key=lambda session: session.last_used)
            for response_id in list(records(oldest)):
                self.chains.drop(response_id)
            await self._tidy(oldest)
            session = await manager.create(None, SessionSettings(), kind=CHAIN)
        return manager.begin_turn(session.id, CHAIN)

    def _keep(self, session: Session, builder: ResponseBuilder, listed: list[dict[str, Any]]) -> None:
        """Store a complete response as the head of the chain it was committed into."""
        response = builder.response
        record = {
            "count": len(session.transcript),
            "created_at": time.time(),
            "response": response.model_dump(mode="json"),
            "input_items": listed,
        }
        self.chains.put(session, response.id, record)

    def _stored(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The caller's stored response; 404 naming param otherwise (another key's is as good as missing)."""
        stored = self.chains.find(response_id, current_principal(), time.time())
        if stored is None:
            what = param.removesuffix("_id")  # response, previous_response
            raise APIError(
                f"{what.replace('_', ' ').capitalize()} with id '{response_id}' not found.",
                status=404,
                type="not_found_error",
                param=param,
                code=f"{what}_not_found",
            )
        return stored

    def _skeleton(self, request: ResponsesRequest, chat: ChatCompletionRequest, response_id: str) -> ResponseObject:
        """The response before any output: the request's settings as they are served."""
        defaults = effective_defaults(self.context.defaults)
        text_format = request.text.format if request.text is not None else None
        return ResponseObject(
            id=response_id,
            created_at=int(time.time()),
            status="in_progress",
            model=request.model,
            instructions=request.instructions,
            output=[],
            output_text="",
            previous_response_id=request.previous_response_id,
            store=request.store,
            max_output_tokens=request.max_output_tokens,
            parallel_tool_calls=request.parallel_tool_calls,
            temperature=request.temperature if request.temperature is not None else defaults.temperature,
            top_p=request.top_p if request.top_p is not None else defaults.top_p,
            top_logprobs=request.top_logprobs,
            tools=request.tools or [],
            tool_choice=request.tool_choice or "auto",
            text=TextSettings(format=text_format or TextFormatText(type="text")),
            reasoning=ReasoningSettings(effort=request.reasoning.effort if request.reasoning is not None else None),
            service_tier=served_tier(chat),
            metadata=request.metadata or {},
            user=request.user,
            safety_identifier=request.safety_identifier,
            prompt_cache_key=request.prompt_cache_key,
            prompt_cache_retention=request.prompt_cache_retention,
            usage=None,
        )

    def _logprobs(self, tokens: list[ReleasedToken]) -> list[dict[str, Any]]:
        return output_logprobs(chat_logprobs(tokens, self.context.strings))
