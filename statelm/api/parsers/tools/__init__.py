"""Streaming tool-call parsers, one per output format, chosen by name (`--tool-parser`) or from the chat template."""

from __future__ import annotations

from statelm.api.parsers.tools.base import (
    ContentDelta,
    ParsedOutput,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallStart,
    ToolEvent,
    ToolParser,
)
from statelm.api.parsers.tools.forced import ForcedToolParser
from statelm.api.parsers.tools.hermes import HermesToolParser
from statelm.api.parsers.tools.llama3 import Llama3JsonToolParser
from statelm.api.parsers.tools.mistral import MistralToolParser
from statelm.api.parsers.tools.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Qwen3CoderToolParser, Llama3JsonToolParser, MistralToolParser)
}
_ALIASES = {"qwen": "hermes", "qwen3_xml": "qwen3_coder", "llama3": "llama3_json", "llama": "llama3_json"}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name` (or an alias such as `qwen`, `llama3`)."""
    parser = TOOL_PARSERS.get(_ALIASES.get(name, name))
    if parser is None:
        raise ValueError(f"unknown tool parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return parser


def detect_tool_parser(template: str | None) -> str | None:
    """The registered parser whose format a chat template's source renders, or None if it has no tool format."""
    if not template:
        return None
    if "<function=" in template and "<parameter=" in template:
        return Qwen3CoderToolParser.name
    if "[TOOL_CALLS]" in template:
        return MistralToolParser.name
    if "<tool_call>" in template:
        return HermesToolParser.name
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return Llama3JsonToolParser.name
    return None


__all__ = [
    "TOOL_PARSERS",
    "ContentDelta",
    "ForcedToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedOutput",
    "Qwen3CoderToolParser",
    "ToolCall",
    "ToolCallArgumentsDelta",
    "ToolCallStart",
    "ToolEvent",
    "ToolParser",
    "detect_tool_parser",
    "get_tool_parser",
]
