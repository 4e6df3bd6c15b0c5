"""Hermes/Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

from statelm.api.parsers.tools.base import BlockScan
from statelm.api.parsers.tools.json_calls import JsonToolParser, skip_space
from statelm.api.parsers.tools.tags import closing_tag_end

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(JsonToolParser):
    """Hermes 2 Pro, Qwen2.5, Qwen3 and QwQ: one JSON call object per `<tool_call>` block."""

    name = "hermes"
    openers = (OPEN,)

    def _scan_block(self, text: str, final: bool) -> BlockScan | None:
        pos = skip_space(text, len(OPEN))
        if pos == len(text):
            return None if final else BlockScan([])
        if text[pos] != "{":
            return None
        call = self._json.read_call_object(text, pos, final)
        draft = call.draft(require_arguments=False)
        if draft is None:
            return None if call.end is not None else BlockScan([])
        if call.end is None:
            return BlockScan([draft])
        return BlockScan([draft], call.end if call.broken else closing_tag_end(text, call.end, CLOSE, final))
