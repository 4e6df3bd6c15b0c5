"""What every tool-call parser shares: the stream events, the scan for call blocks, and the call bookkeeping."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from statelm.api.parsers.partial import partial_marker_suffix


@dataclass(frozen=True)
class ContentDelta:
    """Plain answer text."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A new tool call: its position among the response's calls, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    """More of a call's `arguments` JSON text; the fragments of a call concatenate to its final arguments."""

    index: int
    arguments: str


ToolEvent = ContentDelta | ToolCallStart | ToolCallArgumentsDelta


@dataclass(frozen=True)
class ToolCall:
    """A finished tool call with its arguments as a JSON string, as OpenAI returns it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output split into answer text and tool calls."""

    content: str
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class CallDraft:
    """A call as far as its block's text shows it: the name and the arguments text known so far."""

    name: str
    arguments: str = ""
    id: str | None = None  # an id the model wrote itself (Mistral's [CALL_ID])


@dataclass(frozen=True)
class BlockScan:
    """A format's reading of a tool-call block: its calls so far and, once it is complete, where it ends."""

    calls: list[CallDraft]
    end: int | None = None


@dataclass
class _OpenCall:
    index: int
    id: str
    name: str
    arguments: str = ""


@dataclass
class _Stream:
    buffer: str = ""  # text not yet turned into events
    in_block: bool = False  # buffer starts with a block opener
    pending_space: str = ""  # whitespace before the block: dropped if it holds a call, content if not
    trim: bool = True  # at the start of the output or right after a block, where whitespace is held
    started: bool = False  # content or a block has been seen
    block: list[_OpenCall] = field(default_factory=list)


def tool_parameter_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Function name -> JSON schema of its parameters, from an OpenAI `tools` list."""
    schemas: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        if isinstance(function.get("name"), str):
            schemas[function["name"]] = function.get("parameters") or {}
    return schemas


class ToolParser(ABC):
    """Turns streamed model output into content and tool-call events, holding back only what may open a call.

    A subclass names the text that opens its format's blocks (`openers`, or `_find_opener`) and reads one
    block in `_scan_block`; the base class does the rest. Text is re-read from the block's start on each
    chunk, so the events never depend on how the output was chunked. A block in which no call can be read
    (malformed output) is passed through as content; once a call has been announced it stays a call, with
    whatever arguments the model wrote (OpenAI's own `arguments` may be invalid JSON too).
    Whitespace with nothing but calls and the ends of the output around it is dropped.
    """

    name: ClassVar[str]
    openers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tool_schemas = tool_parameter_schemas(tools)
        self.tool_calls: list[ToolCall] = []
        self._stream = _Stream()

    def feed(self, text: str) -> list[ToolEvent]:
        """Add output text; return the events that are certain now."""
        self._stream.buffer += text
        return self._advance(final=False)

    def finish(self) -> list[ToolEvent]:
        """End of output: return the remaining events; `tool_calls` is then complete."""
        return self._advance(final=True)

    def parse(self, text: str) -> ParsedOutput:
        """Split a whole (non-streamed) output into content and tool calls."""
        events = [*self.feed(text), *self.finish()]
        content = "".join(event.text for event in events if isinstance(event, ContentDelta))
        return ParsedOutput(content, list(self.tool_calls))

    def _new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def _find_opener(self, text: str, at_start: bool) -> tuple[int, bool]:
        """(index, True) of the first block opener in `text`; else (index from which text must be held, False)."""
        hits = [index for opener in self.openers if (index := text.find(opener)) >= 0]
        if hits:
            return min(hits), True
        return len(text) - partial_marker_suffix(text, self.openers), False

    def _find_leading_opener(self, text: str, char: str) -> tuple[int, bool] | None:
        """A block that can only open the output: `char` as its first non-space character."""
        body = text.lstrip()
        if not body:
            return 0, False
        return (len(text) - len(body), True) if body[0] == char else None

    @abstractmethod
    def _scan_block(self, text: str, final: bool) -> BlockScan | None:
        """Read the block `text` starts with; None when it is not a tool call after all.

        Must never take back a call once reported, and only extend its arguments. With `final` (no more text
        will come) the result must be complete (`end` set) or None.
        """

    def _advance(self, final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        stream = self._stream
        while self._block_step(events, final) if stream.in_block else self._text_step(events, final):
            pass
        return events

    def _text_step(self, events: list[ToolEvent], final: bool) -> bool:
        """Emit content up to the next block opener; True when a block starts."""
        stream = self._stream
        index, found = self._find_opener(stream.buffer, at_start=not stream.started)
        before = stream.buffer[:index] if found or not final else stream.buffer
        holding = (stream.trim and before.isspace()) or not before
        if found:
            if holding:
                stream.pending_space = before
            else:
                self._content(events, before)
            stream.buffer, stream.in_block = stream.buffer[index:], True
            return True
        if holding:
            if final:
                if not self.tool_calls:
                    self._content(events, before)
                stream.buffer = ""
            return False
        self._content(events, before)
        stream.buffer = stream.buffer[len(before) :]
        return False

    def _block_step(self, events: list[ToolEvent], final: bool) -> bool:
        """Report the block's calls; True when the block is over and scanning goes on after it."""
        stream = self._stream
        scan = self._scan_block(stream.buffer, final)
        if scan is None or (scan.end is not None and not scan.calls):
            if stream.block:
                raise RuntimeError(f"{type(self).__name__} dropped a tool call it had reported")
            self._content(events, stream.pending_space + stream.buffer[0])
            stream.pending_space, stream.buffer, stream.in_block = "", stream.buffer[1:], False
            return True
        if scan.calls:
            stream.pending_space = ""
        self._report(events, scan.calls)
        if scan.end is None:
            if final:
                raise RuntimeError(f"{type(self).__name__} left a block open at the end of the output")
            return False
        for call in stream.block:
            if not call.arguments:
                call.arguments = "{}"
                events.append(ToolCallArgumentsDelta(call.index, "{}"))
            self.tool_calls.append(ToolCall(call.id, call.name, call.arguments))
        stream.block = []
        stream.buffer, stream.in_block, stream.trim, stream.started = stream.buffer[scan.end :], False, True, True
        return True

    def _report(self, events: list[ToolEvent], drafts: list[CallDraft]) -> None:
        """Events for calls that are new in this reading of the block and for arguments that grew."""
        block = self._stream.block
        if len(drafts) < len(block):
            raise RuntimeError(f"{type(self).__name__} dropped a tool call it had reported")
        for position, draft in enumerate(drafts):
            if position == len(block):
                call = _OpenCall(len(self.tool_calls) + position, draft.id or self._new_call_id(), draft.name)
                block.append(call)
                events.append(ToolCallStart(call.index, call.id, call.name))
            call = block[position]
            if not draft.arguments.startswith(call.arguments):
                raise RuntimeError(f"{type(self).__name__} rewrote the arguments of a tool call it had reported")
            if len(draft.arguments) > len(call.arguments):
                events.append(ToolCallArgumentsDelta(call.index, draft.arguments[len(call.arguments) :]))
                call.arguments = draft.arguments

    def _content(self, events: list[ToolEvent], text: str) -> None:
        if text:
            events.append(ContentDelta(text))
            self._stream.started, self._stream.trim = True, False
