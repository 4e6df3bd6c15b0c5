"""A conversation and its tools in the shape a model's chat template takes, for templates with or without tools.

A template that reads `tools` gets the tool definitions and the history's tool calls and results as structured
fields. Any other template gets them as text in the Hermes format: the tools and a calling instruction in the
system message, calls appended to the assistant's text, results as user messages.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import jinja2

from statelm.api.parsers.tools import HermesToolParser, detect_tool_parser
from statelm.api.protocol import ChatMessage, ToolCallMessage, ToolDefinition

# The parser that reads tool calls written in the format the fallback teaches.
FALLBACK_TOOL_PARSER = HermesToolParser.name

_TOOLS_INSTRUCTION = (
    "You can call the functions below when they help with the request. "
    "Each one is described by a line of JSON:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, reply with one block per call, each holding a JSON object with the function's name "
    "and its arguments:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"parameter": "value"}}}}\n</tool_call>\n'
    "The results come back inside <tool_response></tool_response> tags."
)
_FUNCTION_FIELDS = ("name", "description", "parameters")
# `x.arguments | tojson`, `x['arguments'] | items`, `x.arguments.items()`, `x.arguments is [not] string/mapping`.
_OBJECT_FILTERS = frozenset({"tojson", "items", "dictsort"})
_TYPE_TESTS = frozenset({"string", "mapping"})


@dataclass(frozen=True)
class TemplateFeatures:
    """What a chat template's source reads: tools, structured tool-call arguments, reasoning and its controls."""

    native_tools: bool = False  # reads the `tools` variable
    arguments_as_objects: bool = False  # renders tool-call arguments as a mapping (tojson, items, type tests)
    reasoning_content: bool = False  # shows assistant messages' `reasoning_content`
    enable_thinking: bool = False  # reads the `enable_thinking` variable
    reasoning_effort: bool = False  # reads the `reasoning_effort` variable
    tool_parser: str | None = None  # the tool-call format its source renders (detect_tool_parser)

    @classmethod
    def of(cls, template: str | None) -> TemplateFeatures:
        """The features of a template's source (none for a missing or unreadable one)."""
        return _analyse(template) if template else cls()


@dataclass(frozen=True)
class TemplateInput:
    """The `messages` and `tools` variables to render a template with."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def uses_tools(messages: list[ChatMessage], tools: list[ToolDefinition] | None) -> bool:
    """Whether the request offers tools or its history holds tool calls or tool results."""
    return bool(tools) or any(message.tool_calls or message.role == "tool" for message in messages)


def template_messages(
    messages: list[ChatMessage], tools: list[ToolDefinition] | None, features: TemplateFeatures
) -> TemplateInput:
    """The conversation and tools as plain values the template can render (tools as text when it has none)."""
    if features.native_tools or not uses_tools(messages, tools):
        call_names = {call.id: call.function.name for message in messages for call in message.tool_calls or ()}
        return TemplateInput(
            [_native_message(message, features, call_names) for message in messages],
            [tool.model_dump(exclude_none=True) for tool in tools] if tools else None,
        )
    return TemplateInput(_fallback_messages(messages, tools or [], features), None)


@functools.lru_cache(maxsize=32)
def _analyse(template: str) -> TemplateFeatures:
    tool_parser = detect_tool_parser(template)
    try:
        tokens = [
            (kind, value[1:-1] if kind == "string" else value)
            for _, kind, value in jinja2.Environment().lex(template)
            if kind in ("name", "string", "operator")
        ]
    except jinja2.TemplateSyntaxError:
        return TemplateFeatures(tool_parser=tool_parser)
    return TemplateFeatures(
        native_tools=_reads_variable(tokens, "tools"),
        arguments_as_objects=_treats_arguments_as_mapping(tokens),
        reasoning_content=any(value == "reasoning_content" for kind, value in tokens if kind != "operator"),
        enable_thinking=_reads_variable(tokens, "enable_thinking"),
        reasoning_effort=_reads_variable(tokens, "reasoning_effort"),
        tool_parser=tool_parser,
    )


def _reads_variable(tokens: list[tuple[str, str]], name: str) -> bool:
    """Whether `name` appears as a variable in the template's code (not as an attribute or inside a string)."""
    return any(
        kind == "name" and value == name and (i == 0 or tokens[i - 1] != ("operator", "."))
        for i, (kind, value) in enumerate(tokens)
    )


def _treats_arguments_as_mapping(tokens: list[tuple[str, str]]) -> bool:
    """Whether some `arguments` value is piped to tojson/items, has `.items()` called, or is type-tested."""
    for i, (kind, value) in enumerate(tokens):
        if kind == "operator" or value != "arguments":
            continue
        rest = [value for _, value in tokens[i + 1 : i + 5]]
        if rest[:1] == ["]"]:
            rest = rest[1:]
        if rest[:1] == ["|"] and rest[1:2] and rest[1] in _OBJECT_FILTERS:
            return True
        if rest[:2] == [".", "items"]:
            return True
        if rest[:1] == ["is"]:
            tested = rest[2:3] if rest[1:2] == ["not"] else rest[1:2]
            if tested and tested[0] in _TYPE_TESTS:
                return True
    return False


def _base_message(message: ChatMessage, features: TemplateFeatures) -> dict[str, Any]:
    """Role (developer as system), content as one string, and the name and reasoning the template can take."""
    converted: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
    converted["content"] = message.text()
    if message.name is not None:
        converted["name"] = message.name
    if message.reasoning_content is not None and features.reasoning_content:
        converted["reasoning_content"] = message.reasoning_content
    return converted


def _native_message(message: ChatMessage, features: TemplateFeatures, call_names: dict[str, str]) -> dict[str, Any]:
    """The message with structured tool calls; a tool result is named after its call when it has no name."""
    converted = _base_message(message, features)
    if message.tool_calls:
        converted["tool_calls"] = [_native_call(call, features) for call in message.tool_calls]
    if message.tool_call_id is not None:
        converted["tool_call_id"] = message.tool_call_id
        if "name" not in converted and message.tool_call_id in call_names:
            converted["name"] = call_names[message.tool_call_id]  # some templates (Hermes 2 Pro) require it
    return converted


def _native_call(call: ToolCallMessage, features: TemplateFeatures) -> dict[str, Any]:
    arguments = call.function.arguments
    return {
        "id": call.id,
        "type": "function",
        "function": {
            "name": call.function.name,
            "arguments": _arguments_object(arguments) if features.arguments_as_objects else arguments,
        },
    }


def _arguments_object(arguments: str) -> dict[str, Any] | str:
    """The arguments as a dict when they are a JSON object, else the text as it came."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _fallback_messages(
    messages: list[ChatMessage], tools: list[ToolDefinition], features: TemplateFeatures
) -> list[dict[str, Any]]:
    """Tool calls and results written into the text, and the tools described in the system message."""
    converted: list[dict[str, Any]] = []
    previous_role = None
    for message in messages:
        if message.role == "tool":
            response = f"<tool_response>\n{message.text()}\n</tool_response>"
            if previous_role == "tool":
                converted[-1]["content"] += "\n" + response
            else:
                converted.append({"role": "user", "content": response})
        else:
            item = _base_message(message, features)
            if message.tool_calls:
                calls = "\n".join(_call_text(call) for call in message.tool_calls)
                item["content"] = f"{item['content']}\n{calls}" if item["content"] else calls
            converted.append(item)
        previous_role = message.role
    if tools:
        functions = "\n".join(_dumps(_function_summary(tool)) for tool in tools)
        instruction = _TOOLS_INSTRUCTION.format(tools=functions)
        if converted and converted[0]["role"] == "system":
            first = converted[0]
            first["content"] = f"{first['content']}\n\n{instruction}" if first["content"] else instruction
        else:
            converted.insert(0, {"role": "system", "content": instruction})
    return converted


def _function_summary(tool: ToolDefinition) -> dict[str, Any]:
    dumped = tool.function.model_dump(exclude_none=True)
    return {field: dumped[field] for field in _FUNCTION_FIELDS if field in dumped}


def _call_text(call: ToolCallMessage) -> str:
    payload = {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)}
    return f"<tool_call>\n{_dumps(payload)}\n</tool_call>"
