"""Text that may be the start of a marker split across stream chunks."""

from __future__ import annotations

from collections.abc import Iterable


def partial_marker_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (text to hold back)."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best
