"""Mistral tool calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` and `[TOOL_CALLS]name[ARGS]{...}`."""

from __future__ import annotations

import re
import uuid

from statelm.api.parsers.tools.base import BlockScan, CallDraft
from statelm.api.parsers.tools.json_calls import JsonToolParser, MalformedJson, skip_space

OPEN = "[TOOL_CALLS]"
# Newer tokenizers (v11+: Mistral Small 3.2, Magistral, Devstral): name, optional [CALL_ID]id, [ARGS], JSON.
_HEADER = re.compile(r"([\w.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")
_HEADER_START = re.compile(r"[\w.\-]*(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[[A-Z_]*)?\Z")


class MistralToolParser(JsonToolParser):
    """Mistral 7B v0.3, Mixtral, Nemo, Small and Large: a JSON list of calls, or one `name[ARGS]{...}` per call."""

    name = "mistral"
    openers = (OPEN,)

    def _new_call_id(self) -> str:
        return uuid.uuid4().hex[:9]  # Mistral's templates require 9 alphanumeric characters

    def _scan_block(self, text: str, final: bool) -> BlockScan | None:
        pos = skip_space(text, len(OPEN))
        if pos == len(text):
            return None if final else BlockScan([])
        if text[pos] == "[":
            return self._json.scan_call_list(text, pos + 1, final, separator=",", closer="]")
        if text[pos] == "{":
            return self._json.scan_call_list(text, pos, final, separator=",")
        return self._scan_named_call(text, pos, final)

    def _scan_named_call(self, text: str, pos: int, final: bool) -> BlockScan | None:
        """`name[ARGS]{...}`: the call is announced with its name, then the JSON after [ARGS] streams as arguments."""
        header = _HEADER.match(text, pos)
        if header is None:
            return BlockScan([]) if not final and _HEADER_START.match(text, pos) else None
        name, call_id = header.group(1), header.group(2)
        start = skip_space(text, header.end())
        try:
            end = self._json.value_end(text, start, final)
        except MalformedJson:
            return BlockScan([CallDraft(name, "", call_id)], header.end())
        if end is None and not final:
            streamed = text[start:] if start < len(text) and text[start] in "{[" else ""
            return BlockScan([CallDraft(name, streamed, call_id)])
        return BlockScan([CallDraft(name, text[start:end], call_id)], len(text) if end is None else end)
