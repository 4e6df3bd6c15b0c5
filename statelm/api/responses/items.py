"""A response's input items: as chat messages (for the prompt and the transcript) and as input_items lists them."""

from __future__ import annotations

import uuid
from typing import Any

from statelm.api.protocol import ChatMessage
from statelm.api.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
)

ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def new_id(prefix: str) -> str:
    """A fresh id for a response (`resp`) or an item (`msg`, `fc`, `fco`, `rs`)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(value: str | list[InputItem]) -> list[InputItem]:
    """`input` as items: a string is one user message."""
    return [MessageItem(role="user", content=value)] if isinstance(value, str) else value


def listed_items(items: list[InputItem]) -> list[dict[str, Any]]:
    """The items as GET …/input_items lists them: each with an id and a status, message content as parts."""
    listed = []
    for item in items:
        data = item.model_dump(mode="json", by_alias=True, exclude_none=True)
        data.setdefault("id", new_id(ID_PREFIXES[item.type]))
        data.setdefault("status", "completed")
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            part = {"type": "output_text", "text": item.content, "annotations": []}
            data["content"] = [part if item.role == "assistant" else {"type": "input_text", "text": item.content}]
        listed.append(data)
    return listed


def chat_messages(items: list[InputItem]) -> list[ChatMessage]:
    """The items as the messages of a chat transcript.

    Function calls join the assistant message just before them (or make one); reasoning goes to the next
    assistant message's `reasoning_content`; a function's output is a `tool` message.
    """
    messages: list[dict[str, Any]] = []
    thoughts: list[str] = []

    def assistant(content: str | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thoughts:
            message["reasoning_content"] = "\n".join(thoughts)
            thoughts.clear()
        messages.append(message)
        return message

    for item in items:
        if isinstance(item, ReasoningItem):
            thoughts.append(item.text())
        elif isinstance(item, FunctionCallItem):
            joins = messages and messages[-1]["role"] == "assistant" and not thoughts
            target = messages[-1] if joins else assistant(None)
            function = {"name": item.name, "arguments": item.arguments}
            target.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": function})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        elif item.role == "assistant":
            assistant(item.text())
        else:
            messages.append({"role": item.role, "content": item.text()})
    if thoughts:
        assistant(None)
    return [ChatMessage.model_validate(message) for message in messages]
