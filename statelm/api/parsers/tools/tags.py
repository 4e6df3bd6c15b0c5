"""Reading XML-like tags (`<function=name>`, `</tool_call>`) from text that is still growing."""

from __future__ import annotations

from statelm.api.parsers.tools.json_calls import skip_space

PARTIAL = "partial"  # the text stops before the answer is known


def closing_tag_end(text: str, pos: int, tag: str, final: bool) -> int | None:
    """End of the block: past `tag` if it follows `pos` (after whitespace), else `pos`; None while undecided."""
    after = skip_space(text, pos)
    rest = text[after:]
    if rest.startswith(tag):
        return after + len(tag)
    if not final and tag.startswith(rest):
        return None
    return pos


def read_tag_value(text: str, pos: int, prefix: str, final: bool) -> tuple[str, int] | str | None:
    """`prefix` + value + `>` at `pos`: (value, index past `>`); PARTIAL while undecided; None if it is not there."""
    rest = text[pos:]
    if not rest.startswith(prefix):
        return PARTIAL if not final and prefix.startswith(rest) else None
    start = pos + len(prefix)
    close = text.find(">", start)
    value = text[start:] if close < 0 else text[start:close]
    if "\n" in value or "<" in value or (close >= 0 and not value.strip()):
        return None
    if close < 0:
        return None if final else PARTIAL
    return value.strip(), close + 1
