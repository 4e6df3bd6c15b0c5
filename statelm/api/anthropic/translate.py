"""/v1/messages in the conversation core's terms: a Messages request as the chat request the core serves (its
messages, the prefill its reply continues, its cache breakpoints), and the core's errors named by Anthropic's fields
(the one place that maps them)."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from statelm.api.anthropic.protocol import (
    MessagesInput,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from statelm.api.errors import APIError
from statelm.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionChoice,
    FunctionDefinition,
    JSONSchemaResponseFormat,
    JSONSchemaSpec,
    NamedToolChoice,
    ToolCallMessage,
    ToolDefinition,
)
from statelm.api.translation import chat_request, renamed_parameters

# The core's (chat's) parameter names and the Messages fields they come from
PARAMETERS = {
    "stop": "stop_sequences",
    "thinking_budget": "thinking.budget_tokens",
    "reasoning_effort": "thinking",
    "user": "metadata.user_id",
    "response_format": "output_config.format",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4  # blocks with cache_control in one request, as Anthropic allows
SERVICE_TIERS = {"auto": "auto", "standard_only": "default"}
TOOL_ERROR_PREFIX = "Error: "  # how a tool_result with is_error reads to the model


def messages_errors() -> AbstractContextManager[None]:
    """Name the parameter of any APIError raised inside by the Messages field that set it."""
    return renamed_parameters(PARAMETERS, keep_in_message=frozenset({"reasoning_effort"}))  # a template variable


@dataclass(frozen=True)
class ThinkingSupport:
    """What the model's reasoning allows: whether it writes a think block, whether its template switches it."""

    thinks: bool
    switchable: bool


@dataclass(frozen=True)
class Breakpoint:
    """A `cache_control` breakpoint: the conversation up to its block (rendered without a generation prompt)."""

    ttl_s: float
    messages: list[ChatMessage]


@dataclass(frozen=True)
class Conversation:
    """A Messages request in the core's terms: the chat request, the reply's prefill and the cache breakpoints."""

    chat: ChatCompletionRequest
    prefill: str
    breakpoints: list[Breakpoint]


def conversation(request: MessagesInput, thinking: ThinkingSupport) -> Conversation:
    """The core's request for a Messages request (or a token count) on a model that reasons as `thinking` says."""
    messages, prefill = chat_messages(request)
    return Conversation(_chat(request, messages, thinking), prefill, breakpoints(request))


def chat_messages(request: MessagesInput, *, with_prefill: bool = True) -> tuple[list[ChatMessage], str]:
    """The system prompt and messages as chat messages, and the text of a last assistant message (the prefill)."""
    system = [block.text for block in request.system_blocks()]
    messages = [ChatMessage(role="system", content="".join(system))] if system else []
    prefill = ""
    last = len(request.messages) - 1
    calls: set[str] = set()  # the ids of the tool_use blocks of the assistant message before
    for index, message in enumerate(request.messages):
        where = f"messages.{index}"
        if message.role == "user":
            messages += _user_messages(message.blocks(), calls, where)
            calls = set()
        elif index == last and with_prefill:
            prefill = _prefill(message.blocks(), where)
        else:
            assistant = _assistant_message(message.blocks(), where)
            calls = {call.id for call in assistant.tool_calls or ()}
            messages.append(assistant)
    if not messages:
        raise APIError("messages needs a user message before the assistant's prefill", param="messages")
    return messages, prefill


def _user_messages(blocks: list[Any], calls: set[str], where: str) -> list[ChatMessage]:
    """A user message's blocks as chat messages: a tool message per tool_result, a user message for the text."""
    messages: list[ChatMessage] = []
    text: list[str] = []
    for position, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                raise APIError(
                    f"{where}.content.{position}: tool_result for '{block.tool_use_id}', which is not the id of a "
                    "tool_use block in the assistant message before it",
                    param=f"{where}.content.{position}.tool_use_id",
                )
            result = (TOOL_ERROR_PREFIX if block.is_error else "") + block.text()
            messages.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=result))
        elif isinstance(block, TextBlock):
            text.append(block.text)
        else:
            raise _misplaced(block.type, "user", f"{where}.content.{position}")
    if text:
        messages.append(ChatMessage(role="user", content="".join(text)))
    return messages


def _assistant_message(blocks: list[Any], where: str) -> ChatMessage:
    """An assistant message's blocks as one chat message: its thinking, text and tool calls."""
    text, reasoning, calls = [], [], []
    for position, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(ToolCallMessage(id=block.id, function=FunctionCall(name=block.name, arguments=arguments)))
        else:
            raise _misplaced(block.type, "assistant", f"{where}.content.{position}")
    return ChatMessage(
        role="assistant",
        content="".join(text) if text or not calls else None,
        reasoning_content="".join(reasoning) or None,
        tool_calls=calls or None,
    )


def _prefill(blocks: list[Any], where: str) -> str:
    """The text a last assistant message starts the reply with."""
    for position, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise APIError(
                f"{where}.content.{position}: the last assistant message is a prefill that the reply continues, "
                f"so it holds text blocks only, not {block.type}",
                param=f"{where}.content.{position}",
            )
    return "".join(block.text for block in blocks)


def _misplaced(kind: str, role: str, where: str) -> APIError:
    owner = {"tool_result": "a user", "tool_use": "an assistant", "thinking": "an assistant"}.get(kind, "no")
    return APIError(f"{where}: a {kind} block belongs to {owner} message, not to a {role} message", param=where)


def breakpoints(request: MessagesInput) -> list[Breakpoint]:
    """The request's `cache_control` breakpoints, each with the conversation up to its block.

    A breakpoint on a tool or a system block covers the system prompt with every tool (templates render the tools
    with the system prompt); one on a message block covers the conversation up to and including that block. More
    than MAX_BREAKPOINTS blocks with cache_control (the top-level one included) are refused.
    """
    count = _breakpoint_count(request)
    if count > MAX_BREAKPOINTS:
        raise APIError(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {count}.",
            param="cache_control",
        )
    found: list[Breakpoint] = []
    if request.cache_control is not None:
        whole = chat_messages(request, with_prefill=False)[0]
        found.append(Breakpoint(TTL_SECONDS[request.cache_control.ttl], whole))
    system = request.system_blocks()
    head = [block for block in [*(request.tools or ()), *system] if block.cache_control is not None]
    if head:
        ttl = max(TTL_SECONDS[block.cache_control.ttl] for block in head)  # type: ignore[union-attr]
        system_text = "".join(block.text for block in system)
        found.append(Breakpoint(ttl, [ChatMessage(role="system", content=system_text)] if system else []))
    for index, message in enumerate(request.messages):
        for position, block in enumerate(message.blocks()):
            control = getattr(block, "cache_control", None)
            if control is None:
                continue
            partial = message.model_copy(update={"content": message.blocks()[: position + 1]})
            upto = request.model_copy(update={"messages": [*request.messages[:index], partial]})
            found.append(Breakpoint(TTL_SECONDS[control.ttl], chat_messages(upto, with_prefill=False)[0]))
    return found


def _breakpoint_count(request: MessagesInput) -> int:
    """How many blocks (tools, system and message blocks, and the request itself) carry cache_control."""
    blocks = [*(request.tools or ()), *request.system_blocks(), *(b for m in request.messages for b in m.blocks())]
    return (request.cache_control is not None) + sum(getattr(b, "cache_control", None) is not None for b in blocks)


def _chat(request: MessagesInput, messages: list[ChatMessage], support: ThinkingSupport) -> ChatCompletionRequest:
    """The chat request that generates the reply to messages.

    Thinking enabled is the core's reasoning budget (and its template switch, if it has one); disabled switches it
    off, which a model that thinks without a switch refuses, and a model that never thinks has already done.
    """
    tools = [
        ToolDefinition(
            type="function",
            function=FunctionDefinition(name=tool.name, description=tool.description, parameters=tool.input_schema),
        )
        for tool in request.tools or ()
    ]
    fields: dict[str, Any] = {"model": request.model, "messages": messages, "tools": tools or None}
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = (
            NamedToolChoice(type="function", function=FunctionChoice(name=choice.name))
            if isinstance(choice, ToolChoiceTool)
            else "required"
            if isinstance(choice, ToolChoiceAny)
            else choice.type
        )
        if not isinstance(choice, ToolChoiceNone):
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    thinking = request.thinking
    if isinstance(thinking, ThinkingEnabled):
        fields["thinking_budget"] = thinking.budget_tokens
        if support.switchable:
            fields["reasoning_effort"] = "high"
    elif thinking is not None and support.thinks:
        fields["reasoning_effort"] = "none"
    output = request.output_config
    if output is not None and output.effort is not None:
        fields["reasoning_effort"] = output.effort
    if output is not None and output.format is not None:
        spec = JSONSchemaSpec(name="output", schema=output.format.json_schema)
        fields["response_format"] = JSONSchemaResponseFormat(type="json_schema", json_schema=spec)
    if isinstance(request, MessagesRequest):
        fields |= {
            "max_tokens": request.max_tokens,
            "stop": request.stop_sequences or None,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "user": request.metadata.user_id if request.metadata is not None else None,
            "service_tier": SERVICE_TIERS[request.service_tier] if request.service_tier is not None else None,
        }
    return chat_request(fields, PARAMETERS)
