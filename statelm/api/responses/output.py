"""A generation's events as a response: its output items and OpenAI's typed stream events, in order and numbered.

The same builder serves a streamed response and a whole one (which keeps only the final object), so the two
agree. Items open as the output turns to them (reasoning, a message, a function call) and close when another
opens or the generation ends:

    response.created, response.in_progress,
    per item: response.output_item.added, [response.content_part.added], deltas
              (response.reasoning_text.delta | response.output_text.delta | response.function_call_arguments.delta),
              the text's or arguments' .done, [response.content_part.done], response.output_item.done,
    response.completed (or response.incomplete when max_output_tokens cut it, response.failed on an engine error).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from statelm.api.chat_output import ChoiceEvent
from statelm.api.generation import GenerationStats, ReleasedToken
from statelm.api.protocol import DeltaToolCall, ToolCallMessage
from statelm.api.responses.items import ID_PREFIXES, new_id
from statelm.api.responses.objects import (
    FunctionCall,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    Reasoning,
    ReasoningTextPart,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from statelm.api.responses.protocol import ItemStatus
from statelm.api.serving import timings_of
from statelm.engine.client import FinishReason

Event = dict[str, Any]  # one stream event: `type`, `sequence_number` and its fields
DELTA_EVENTS = {
    "message": "response.output_text.delta",
    "reasoning": "response.reasoning_text.delta",
    "function_call": "response.function_call_arguments.delta",
}
OBFUSCATION_BLOCK = 16  # deltas are padded to a multiple of this many characters


@dataclass
class OpenItem:
    """The output item being written: its kind, place, id, text so far (arguments for a call) and logprobs."""

    kind: str
    index: int
    id: str
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


class ResponseBuilder:
    """Turns one generation's events into a response and the stream events that build it.

    `logprobs` turns released tokens into output_text logprobs when the request includes them; `obfuscate`
    pads deltas with random characters.
    """

    def __init__(
        self,
        response: ResponseObject,
        logprobs: Callable[[list[ReleasedToken]], list[dict[str, Any]]] | None = None,
        obfuscate: bool = False,
    ) -> None:
        self.response = response
        self.logprobs = logprobs
        self.obfuscate = obfuscate
        self.sequence = 0
        self.current: OpenItem | None = None
        self.finished = False

    def started(self) -> list[Event]:
        """The events that open the stream."""
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def add(self, event: ChoiceEvent) -> list[Event]:
        """The stream events one generation event makes; at the last, the response is complete."""
        events: list[Event] = []
        piece = event.piece
        if piece.reasoning:
            events += self._text("reasoning", piece.reasoning, [])
        if piece.content:
            events += self._text("message", piece.content, event.tokens)
        for call in piece.tool_calls:
            events += self._call(call)
        if event.finish_reason is not None and event.stats is not None:
            events += self._finish(event, event.stats)
        return events

    def failed(self, message: str) -> list[Event]:
        """The events that end a stream whose generation failed."""
        events = self._close("incomplete")
        self.response.status = "failed"
        self.response.error = ResponseError(message=message)
        self.finished = True
        return [*events, self._lifecycle("response.failed")]

    def _text(self, kind: str, text: str, tokens: list[ReleasedToken]) -> list[Event]:
        events = [] if self.current is not None and self.current.kind == kind else self._open(kind)
        item = self.current
        assert item is not None
        item.text += text
        logprobs = self.logprobs(tokens) if self.logprobs is not None and kind == "message" else []
        item.logprobs += logprobs
        fields: dict[str, Any] = {"item_id": item.id, "output_index": item.index, "content_index": 0, "delta": text}
        if kind == "message":
            fields["logprobs"] = logprobs
        return [*events, self._delta(DELTA_EVENTS[kind], fields)]

    def _call(self, call: DeltaToolCall) -> list[Event]:
        events = []
        if call.id is not None:
            events += self._open("function_call", call_id=call.id, name=call.function.name or "")
        item = self.current
        if item is None or item.kind != "function_call" or not call.function.arguments:
            return events
        item.text += call.function.arguments
        fields = {"item_id": item.id, "output_index": item.index, "delta": call.function.arguments}
        return [*events, self._delta(DELTA_EVENTS["function_call"], fields)]

    def _open(self, kind: str, call_id: str = "", name: str = "") -> list[Event]:
        events = self._close("completed")
        item = OpenItem(kind, len(self.response.output), new_id(ID_PREFIXES[kind]), call_id=call_id, name=name)
        self.current = item
        events.append(self._event("response.output_item.added", output_index=item.index, item=self._item(item)))
        if kind != "function_call":
            part = self._part(item)
            fields = {"item_id": item.id, "output_index": item.index, "content_index": 0, "part": part}
            events.append(self._event("response.content_part.added", **fields))
        return events

    def _close(self, status: ItemStatus, final_calls: dict[str, ToolCallMessage] | None = None) -> list[Event]:
        item, self.current = self.current, None
        if item is None:
            return []
        events = []
        at = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            final = (final_calls or {}).get(item.call_id)
            item.text = final.function.arguments if final is not None else item.text
            events.append(self._event("response.function_call_arguments.done", **at, arguments=item.text))
        else:
            if item.kind == "message":
                done = {"text": item.text, "logprobs": item.logprobs}
                events.append(self._event("response.output_text.done", **at, content_index=0, **done))
            else:
                events.append(self._event("response.reasoning_text.done", **at, content_index=0, text=item.text))
            part = self._part(item, status)
            events.append(self._event("response.content_part.done", **at, content_index=0, part=part))
        finished = self._item(item, status)
        self.response.output.append(finished)
        events.append(self._event("response.output_item.done", output_index=item.index, item=finished))
        return events

    def _finish(self, last: ChoiceEvent, stats: GenerationStats) -> list[Event]:
        cut = last.finish_reason == FinishReason.LENGTH.value
        events = self._close("incomplete" if cut else "completed", {call.id: call for call in last.tool_calls or ()})
        response = self.response
        messages = [item for item in response.output if isinstance(item, OutputMessage)]
        response.output_text = "".join(part.text for item in messages for part in item.content)
        response.usage = ResponseUsage(
            input_tokens=stats.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=stats.cached_tokens, cache_write_tokens=stats.prompt_tokens - stats.cached_tokens
            ),
            output_tokens=stats.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=last.reasoning_tokens),
            total_tokens=stats.prompt_tokens + stats.completion_tokens,
        )
        response.timings = timings_of(stats)
        response.status = "incomplete" if cut else "completed"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut else None
        response.completed_at = int(time.time())
        self.finished = True
        return [*events, self._lifecycle("response.incomplete" if cut else "response.completed")]

    def _item(self, item: OpenItem, status: ItemStatus = "in_progress") -> OutputItem:
        if item.kind == "function_call":
            return FunctionCall(id=item.id, call_id=item.call_id, name=item.name, arguments=item.text, status=status)
        content: list[Any] = [] if status == "in_progress" else [self._part(item, status)]
        if item.kind == "reasoning":
            return Reasoning(id=item.id, content=content, status=status)
        return OutputMessage(id=item.id, content=content, status=status)

    def _part(self, item: OpenItem, status: ItemStatus = "in_progress") -> OutputText | ReasoningTextPart:
        text = "" if status == "in_progress" else item.text
        if item.kind == "reasoning":
            return ReasoningTextPart(text=text)
        logprobs = None if self.logprobs is None else ([] if status == "in_progress" else item.logprobs)
        return OutputText(text=text, logprobs=logprobs)

    def _lifecycle(self, kind: str) -> Event:
        return self._event(kind, response=self.response)

    def _delta(self, kind: str, fields: dict[str, Any]) -> Event:
        if self.obfuscate:
            padding = OBFUSCATION_BLOCK - len(fields["delta"]) % OBFUSCATION_BLOCK
            fields["obfuscation"] = secrets.token_urlsafe(OBFUSCATION_BLOCK)[:padding]
        return self._event(kind, **fields)

    def _event(self, kind: str, **fields: Any) -> Event:
        """The next event, its objects as JSON values (taken now: the response object changes later)."""
        values = {
            name: value.model_dump(mode="json") if isinstance(value, BaseModel) else value
            for name, value in fields.items()
        }
        event = {"type": kind, "sequence_number": self.sequence, **values}
        self.sequence += 1
        return event
