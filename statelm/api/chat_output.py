"""One choice's text split into reasoning, answer and tool calls, the same way streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from statelm.api.generation import GenerationStats, ReleasedToken, TextDelta
from statelm.api.parsers.reasoning import ReasoningParser, ReasoningSpan
from statelm.api.parsers.tools import (
    ContentDelta,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallStart,
    ToolEvent,
    ToolParser,
)
from statelm.api.protocol import AssistantMessage, DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCallMessage
from statelm.engine.client import FinishReason

TOOL_CALLS_FINISH = "tool_calls"  # the finish reason of a choice that made tool calls


@dataclass
class ChatPiece:
    """What a stretch of output adds to a choice's message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChoiceOutputParser:
    """Routes a choice's streamed text: the think block to reasoning, the rest through the tool parser if any.

    With `single_call` (parallel_tool_calls false) only the first tool call is kept; `span` finds the think
    block in the choice's token ids, to count its tokens.
    """

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        *,
        single_call: bool = False,
        span: ReasoningSpan | None = None,
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._max_calls = 1 if single_call else None
        self._span = span

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of the choice's tokens its think block took (0 for a model that does not reason)."""
        return self._span.count(token_ids) if self._span is not None else 0

    def feed(self, text: str) -> ChatPiece:
        """The reasoning, content and tool-call deltas that `text` makes certain."""
        if self._reasoning is None:
            return self._answer("", text, final=False)
        delta = self._reasoning.feed(text)
        return self._answer(delta.reasoning, delta.content, final=False)

    def finish(self) -> ChatPiece:
        """Whatever was held back, at the end of the output."""
        if self._reasoning is None:
            return self._answer("", "", final=True)
        delta = self._reasoning.finish()
        return self._answer(delta.reasoning, delta.content, final=True)

    @property
    def tool_calls(self) -> list[ToolCallMessage]:
        """The finished tool calls, once `finish` has run."""
        calls: list[ToolCall] = self._tools.tool_calls if self._tools is not None else []
        return [
            ToolCallMessage(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in calls[: self._max_calls]
        ]

    def _answer(self, reasoning: str, content: str, *, final: bool) -> ChatPiece:
        if self._tools is None:
            return ChatPiece(reasoning, content)
        events = self._tools.feed(content) if content else []
        if final:
            events += self._tools.finish()
        piece = ChatPiece(reasoning)
        for event in events:
            self._add_event(piece, event)
        return piece

    def _add_event(self, piece: ChatPiece, event: ToolEvent) -> None:
        if isinstance(event, ContentDelta):
            piece.content += event.text
            return
        if self._max_calls is not None and event.index >= self._max_calls:
            return
        last = piece.tool_calls[-1] if piece.tool_calls else None
        if isinstance(event, ToolCallStart):
            function = DeltaFunctionCall(name=event.name)
            piece.tool_calls.append(DeltaToolCall(index=event.index, id=event.id, type="function", function=function))
        elif isinstance(event, ToolCallArgumentsDelta):
            if last is not None and last.index == event.index:
                last.function.arguments += event.arguments
            else:
                piece.tool_calls.append(
                    DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.arguments))
                )


@dataclass
class ChoiceEvent:
    """A choice's next piece of message, the tokens given out with it, and at its end the finish reason."""

    index: int
    piece: ChatPiece
    tokens: list[ReleasedToken]
    finish_reason: str | None = None
    repetition_detected: bool = False
    tool_calls: list[ToolCallMessage] | None = None  # at the finish: every call the choice made
    reasoning_tokens: int = 0  # at the finish: the tokens its think block took
    stop_string: str | None = None  # at the finish: the stop string that ended it
    stats: GenerationStats | None = None  # on the generation's very last event


async def chat_events(
    deltas: AsyncIterator[TextDelta], parsers: list[ChoiceOutputParser]
) -> AsyncIterator[ChoiceEvent]:
    """The text deltas of a generation read by one output parser per choice.

    A choice that ends having made tool calls finishes with `tool_calls` rather than `stop`.
    """
    async for delta in deltas:
        parser = parsers[delta.index]
        piece = parser.feed(delta.text)
        event = ChoiceEvent(delta.index, piece, delta.tokens, stats=delta.stats)
        if delta.finish_reason is not None:
            rest = parser.finish()
            piece.reasoning += rest.reasoning
            piece.content += rest.content
            piece.tool_calls += rest.tool_calls
            event.tool_calls = parser.tool_calls
            event.reasoning_tokens = parser.reasoning_tokens(delta.token_ids)
            event.finish_reason = delta.finish_reason
            if event.tool_calls and delta.finish_reason == FinishReason.STOP.value:
                event.finish_reason = TOOL_CALLS_FINISH
            event.repetition_detected = delta.repetition_detected
            event.stop_string = delta.stop_string
        yield event


@dataclass
class ChoiceMessage:
    """A whole choice gathered from its events: the assistant message, its tokens and how it ended."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallMessage] = field(default_factory=list)
    tokens: list[ReleasedToken] = field(default_factory=list)
    finish_reason: str | None = None
    repetition_detected: bool = False
    stop_string: str | None = None

    def add(self, event: ChoiceEvent) -> None:
        """Take in the choice's next event."""
        self.reasoning += event.piece.reasoning
        self.content += event.piece.content
        self.tokens += event.tokens
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.tool_calls = event.tool_calls or []
            self.repetition_detected = event.repetition_detected
            self.stop_string = event.stop_string

    def message(self) -> AssistantMessage:
        """The choice as the assistant message of a response."""
        return AssistantMessage(
            content=None if self.tool_calls and not self.content else self.content,
            reasoning_content=self.reasoning or None,
            tool_calls=self.tool_calls or None,
        )


async def collect_choices(
    events: AsyncIterator[ChoiceEvent], count: int
) -> tuple[list[ChoiceMessage], GenerationStats]:
    """Every choice of a generation in full, and its stats."""
    choices = [ChoiceMessage() for _ in range(count)]
    stats: GenerationStats | None = None
    async for event in events:
        choices[event.index].add(event)
        stats = event.stats or stats
    if stats is None:
        raise RuntimeError("the generation ended before all its choices finished")
    return choices, stats
