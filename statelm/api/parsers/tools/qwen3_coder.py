"""Qwen3-Coder XML tool calls: `<tool_call><function=name><parameter=key>value</parameter></function></tool_call>`."""

from __future__ import annotations

import json
from typing import Any

from statelm.api.parsers.tools.base import BlockScan, CallDraft, ToolParser
from statelm.api.parsers.tools.json_calls import skip_space
from statelm.api.parsers.tools.tags import PARTIAL, closing_tag_end, read_tag_value

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
_VALUE_ENDS = (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE)  # a model may forget </parameter>


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder (and Qwen3.5/GLM-style XML): parameters arrive one by one and stream as JSON members.

    Values are raw text, typed by the tool's JSON schema: strings stay strings, other types are read as JSON
    (falling back to a string); a parameter the schema does not know is a string.
    """

    name = "qwen3_coder"
    openers = (TOOL_OPEN, FUNCTION_OPEN)

    def _scan_block(self, text: str, final: bool) -> BlockScan | None:
        wrapped = text.startswith(TOOL_OPEN)
        pos = skip_space(text, len(TOOL_OPEN)) if wrapped else 0
        header = read_tag_value(text, pos, FUNCTION_OPEN, final)
        if header is None or header == PARTIAL:
            return None if header is None else BlockScan([])
        name, pos = header
        members: list[str] = []
        while True:
            pos = skip_space(text, pos)
            rest = text[pos:]
            if rest.startswith(FUNCTION_CLOSE):
                pos += len(FUNCTION_CLOSE)
                end = closing_tag_end(text, pos, TOOL_CLOSE, final) if wrapped else pos
                return BlockScan([CallDraft(name, _arguments(members, closed=True))], end)
            tag = read_tag_value(text, pos, PARAMETER_OPEN, final)
            if not final and (tag == PARTIAL or FUNCTION_CLOSE.startswith(rest)):
                return BlockScan([CallDraft(name, _arguments(members, closed=False))])
            if tag is None or tag == PARTIAL:
                return BlockScan([CallDraft(name, _arguments(members, closed=True))], pos)
            key, value_start = tag
            ends = [(index, tag_end) for tag_end in _VALUE_ENDS if (index := text.find(tag_end, value_start)) >= 0]
            if not ends and not final:
                return BlockScan([CallDraft(name, _arguments(members, closed=False))])
            value_end, tag_end = min(ends) if ends else (len(text), "")
            members.append(self._member(name, key, text[value_start:value_end]))
            pos = value_end + len(tag_end) if tag_end == PARAMETER_CLOSE else value_end

    def _member(self, function: str, key: str, raw: str) -> str:
        """`"key": value` with the value typed by the tool's schema."""
        value = raw.removeprefix("\n").removesuffix("\n")
        schema: Any = self.tool_schemas.get(function, {}).get("properties", {}).get(key, {})
        types = schema.get("type") if isinstance(schema, dict) else None
        types = types if isinstance(types, list) else [types]
        typed: Any = value
        if types != [None] and "string" not in types:
            try:
                typed = json.loads(value)
            except ValueError:
                typed = value
        return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(typed, ensure_ascii=False)}"


def _arguments(members: list[str], closed: bool) -> str:
    """The arguments object as far as its members are known; `{}` closes it."""
    if not members:
        return "{}" if closed else ""
    return "{" + ", ".join(members) + ("}" if closed else "")
