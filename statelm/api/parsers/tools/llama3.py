"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, alone or after `<|python_tag|>`, `;`-separated."""

from __future__ import annotations

from statelm.api.parsers.tools.base import BlockScan
from statelm.api.parsers.tools.json_calls import JsonToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(JsonToolParser):
    """Llama 3.1/3.2/3.3: the output is the call. A `{` opens one only as the output's first character, and it
    must name both the function and its `parameters` (or `arguments`), so a plain JSON answer stays content."""

    name = "llama3_json"
    openers = (PYTHON_TAG,)

    def _find_opener(self, text: str, at_start: bool) -> tuple[int, bool]:
        leading = self._find_leading_opener(text, "{") if at_start else None
        return leading or super()._find_opener(text, at_start)

    def _scan_block(self, text: str, final: bool) -> BlockScan | None:
        pos = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
        return self._json.scan_call_list(text, pos, final, separator=";", require_arguments=True)
