"""Stop strings matched across token and chunk boundaries, holding back text that might begin one."""

from __future__ import annotations


class StopStringMatcher:
    """Feeds generated text through, releasing only text that can no longer be part of a stop string."""

    def __init__(self, stop_strings: list[str]) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Add text; return what may be emitted now (after a match, `stopped` is set and the rest dropped)."""
        if self.stopped:
            return ""
        buffer = self._held + text
        found = [(i, s) for s in self.stop_strings if (i := buffer.find(s)) >= 0]
        if found:
            match, self.matched = min(found, key=lambda hit: hit[0])
            self.stopped = True
            self._held = ""
            return buffer[:match]
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release held-back text when generation ends without a match."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
