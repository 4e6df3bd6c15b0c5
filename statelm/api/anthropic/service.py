"""/v1/messages served by the conversation core: translated in, generated as a chat request, built back as blocks.

Usage follows the engine: `cache_read_input_tokens` are the prompt tokens whose KV it reused,
`cache_creation_input_tokens` the ones up to the last `cache_control` breakpoint (in whole KV blocks, which is what
the cache holds) that it computed and cached, and `input_tokens` the rest. Each breakpoint's prefix is asked of the
engine as a cache pin for its TTL, charged to the caller's key.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from statelm.api.anthropic.errors import anthropic_error
from statelm.api.anthropic.output import Event, MessageBuilder
from statelm.api.anthropic.protocol import CountTokensRequest, MessageObject, MessagesRequest, TokenCount, Usage
from statelm.api.anthropic.translate import Conversation, ThinkingSupport, conversation, messages_errors
from statelm.api.chat_output import ChoiceEvent
from statelm.api.chat_prompt import RenderedPrompt
from statelm.api.conversation import ConversationService
from statelm.api.errors import APIError
from statelm.api.generation import GenerationStats
from statelm.engine.client import CachePinRequest, EngineError, common_prefix_length
from statelm.sessions.ownership import current_principal


@dataclass(frozen=True)
class CachedPrefix:
    """The prompt's prefixes up to its breakpoints, in whole KV blocks, as the pins asked of the engine."""

    cache_pins: tuple[CachePinRequest, ...] = ()

    @property
    def tokens(self) -> int:
        """The longest prefix, up to the last breakpoint (0 without a breakpoint)."""
        return max((pin.num_tokens for pin in self.cache_pins), default=0)

    def usage(self, stats: GenerationStats) -> Usage:
        """A finished generation's usage in Anthropic's terms."""
        read = stats.cached_tokens
        written = max(0, self.tokens - read)
        return Usage(
            input_tokens=stats.prompt_tokens - read - written,
            output_tokens=stats.completion_tokens,
            cache_creation_input_tokens=written,
            cache_read_input_tokens=read,
        )


class MessagesService:
    """Serves /v1/messages and its token count from the conversation core."""

    def __init__(self, conversations: ConversationService) -> None:
        self.conversations = conversations
        self.context = conversations.context

    async def create(self, request: MessagesRequest) -> MessageObject:
        """Generate a whole reply."""
        builder, generation = await self._start(request)
        async for event in generation:
            builder.add(event)
        return builder.message

    async def stream(self, request: MessagesRequest) -> AsyncIterator[Event]:
        """The reply's stream events; errors before the first one are raised, an engine failure ends the stream."""
        builder, generation = await self._start(request)
        return self._events(builder, generation)

    async def count_tokens(self, request: CountTokensRequest) -> TokenCount:
        """How many tokens the request's prompt has."""
        with messages_errors():
            self.context.model.check(request.model)
            translated = self._translate(request)
            prompt = await self.conversations.prompt(translated.chat, translated.chat.messages, translated.prefill)
        return TokenCount(input_tokens=len(prompt.ids))

    async def _events(self, builder: MessageBuilder, generation: AsyncIterator[ChoiceEvent]) -> AsyncIterator[Event]:
        for event in builder.started():
            yield event
        try:
            async for generated in generation:
                for event in builder.add(generated):
                    yield event
        except EngineError as exc:
            yield anthropic_error(APIError(str(exc), status=500, type="server_error"))

    async def _start(self, request: MessagesRequest) -> tuple[MessageBuilder, AsyncIterator[ChoiceEvent]]:
        """Validate, render and admit the request: its message builder and its (not yet started) generation."""
        message_id = f"msg_{uuid.uuid4().hex}"
        with messages_errors():
            translated = self._translate(request)
            chat = translated.chat
            self.conversations.admit(chat, message_id)
            prompt = await self.conversations.prompt(chat, chat.messages, translated.prefill)
            cached = await self._cached_prefix(translated, prompt)
            generation = await self.conversations.generate_prompt(chat, message_id, prompt, cached.cache_pins)
        skeleton = MessageObject(
            id=message_id, model=request.model, content=[], usage=Usage(input_tokens=len(prompt.ids), output_tokens=0)
        )
        return MessageBuilder(skeleton, cached.usage), generation

    def _translate(self, request: CountTokensRequest | MessagesRequest) -> Conversation:
        prompter = self.context.prompter
        features = prompter.features
        support = ThinkingSupport(
            thinks=prompter.reasoning_tags is not None, switchable=features.enable_thinking or features.reasoning_effort
        )
        return conversation(request, support)

    async def _cached_prefix(self, translated: Conversation, prompt: RenderedPrompt) -> CachedPrefix:
        """The prompt's prefixes up to its breakpoints: each one's conversation rendered, matched by tokens, cut to
        whole blocks, and pinned for the longest TTL asked of it."""
        engine = self.context.engine.info
        if not translated.breakpoints or not engine.prefix_caching:
            return CachedPrefix()
        kwargs = self.context.prompter.template_kwargs(translated.chat, {})
        ttls: dict[int, float] = {}
        for breakpoint in translated.breakpoints:
            rendered = await self.context.render(
                breakpoint.messages, translated.chat.tools, kwargs, add_generation_prompt=False
            )
            shared = common_prefix_length(rendered.ids, prompt.ids)
            length = min(shared, len(prompt.ids) - 1)  # the cache leaves the prompt's last token to compute
            length -= length % engine.block_size
            if length:
                ttls[length] = max(ttls.get(length, 0.0), breakpoint.ttl_s)
        owner = current_principal().owner
        return CachedPrefix(tuple(CachePinRequest(length, ttl, owner) for length, ttl in sorted(ttls.items())))
