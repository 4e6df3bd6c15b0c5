"""The output of a forced tool call: the JSON list `grammar.tool_call_schema` constrains it to."""

from __future__ import annotations

from statelm.api.parsers.tools.base import BlockScan
from statelm.api.parsers.tools.json_calls import JsonToolParser


class ForcedToolParser(JsonToolParser):
    """Parses `[{"name": ..., "arguments": {...}}, ...]`, what tool_choice `required` or a named function yields."""

    name = "forced"

    def _find_opener(self, text: str, at_start: bool) -> tuple[int, bool]:
        leading = self._find_leading_opener(text, "[") if at_start else None
        return leading or (len(text), False)

    def _scan_block(self, text: str, final: bool) -> BlockScan | None:
        return self._json.scan_call_list(text, 1, final, separator=",", closer="]")
