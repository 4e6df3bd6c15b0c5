"""The core's generation events as Anthropic's content blocks and stream events, one builder for both.

Blocks come in the order the model wrote them: `thinking` (closed by its `signature`), `text`, `tool_use` (its
arguments streamed as `input_json_delta` pieces, its `input` the parsed whole).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from typing import Any

from statelm.api.anthropic.protocol import MessageObject, Usage
from statelm.api.chat_output import TOOL_CALLS_FINISH, ChoiceEvent
from statelm.api.generation import GenerationStats
from statelm.api.protocol import ToolCallMessage
from statelm.engine.client import FinishReason

Event = dict[str, Any]
STOP_REASONS = {FinishReason.LENGTH.value: "max_tokens", TOOL_CALLS_FINISH: "tool_use"}


def signature(thinking: str) -> str:
    """A thinking block's signature: the digest of its text (statelm keeps no secret to sign with)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def tool_use_id(call_id: str) -> str:
    """A tool call's id as Anthropic's clients expect it (`toolu_…`)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(call: ToolCallMessage) -> dict[str, Any]:
    """A finished call's arguments as the `input` object (arguments that are not an object are under `arguments`)."""
    try:
        parsed = json.loads(call.function.arguments or "{}")
    except ValueError:
        parsed = call.function.arguments
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


class MessageBuilder:
    """Builds the reply message from generation events, and the stream events that say each step of it."""

    def __init__(self, message: MessageObject, usage: Callable[[GenerationStats], Usage]) -> None:
        self.message = message
        self._usage = usage
        self._open: str | None = None  # the type of the block being written

    def started(self) -> list[Event]:
        """`message_start` with the message as it stands, and a first `ping`."""
        start = self.message.model_dump(mode="json")
        return [{"type": "message_start", "message": start}, {"type": "ping"}]

    def add(self, event: ChoiceEvent) -> list[Event]:
        """The stream events of one generation event; its final one closes the message."""
        piece = event.piece
        events: list[Event] = []
        if piece.reasoning:
            events += self._write("thinking", {"type": "thinking_delta", "thinking": piece.reasoning})
        if piece.content:
            events += self._write("text", {"type": "text_delta", "text": piece.content})
        for call in piece.tool_calls:
            if call.id is not None:
                events += self._close()
                block = {"type": "tool_use", "id": tool_use_id(call.id), "name": call.function.name, "input": {}}
                events += self._start(block)
            if call.function.arguments:
                events += self._write("tool_use", {"type": "input_json_delta", "partial_json": call.function.arguments})
        if event.finish_reason is not None:
            events += self._close()
            events += self._finish(event)
        return events

    def _write(self, kind: str, delta: dict[str, Any]) -> list[Event]:
        """A delta of a block of kind, opening one first if another kind is open."""
        events: list[Event] = []
        if self._open != kind:
            events += self._close()
            empty = {"thinking": {"thinking": "", "signature": ""}, "text": {"text": ""}}[kind]
            events += self._start({"type": kind, **empty})
        block = self.message.content[-1]
        if delta["type"] == "thinking_delta":
            block["thinking"] += delta["thinking"]
        elif delta["type"] == "text_delta":
            block["text"] += delta["text"]
        events.append({"type": "content_block_delta", "index": len(self.message.content) - 1, "delta": delta})
        return events

    def _start(self, block: dict[str, Any]) -> list[Event]:
        self.message.content.append(block)
        self._open = block["type"]
        start = {"type": "content_block_start", "index": len(self.message.content) - 1, "content_block": dict(block)}
        return [start]

    def _close(self) -> list[Event]:
        """The end of the open block (a thinking block gets its signature first)."""
        if self._open is None:
            return []
        index = len(self.message.content) - 1
        block = self.message.content[index]
        events: list[Event] = []
        if self._open == "thinking":
            block["signature"] = signature(block["thinking"])
            delta = {"type": "signature_delta", "signature": block["signature"]}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        self._open = None
        return [*events, {"type": "content_block_stop", "index": index}]

    def _finish(self, event: ChoiceEvent) -> list[Event]:
        """The message's end: each call's parsed input, the stop reason and the usage."""
        calls = iter(event.tool_calls or ())
        for block in self.message.content:
            if block["type"] == "tool_use":
                call = next(calls, None)
                if call is not None:
                    block["input"] = tool_input(call)
        message = self.message
        message.stop_reason = STOP_REASONS.get(event.finish_reason or "")
        if message.stop_reason is None:
            message.stop_reason = "end_turn" if event.stop_string is None else "stop_sequence"
            message.stop_sequence = event.stop_string
        if event.stats is not None:
            message.usage = self._usage(event.stats)
        delta = {"stop_reason": message.stop_reason, "stop_sequence": message.stop_sequence}
        usage = message.usage.model_dump()
        return [{"type": "message_delta", "delta": delta, "usage": usage}, {"type": "message_stop"}]
