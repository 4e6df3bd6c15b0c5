"""Drafts of a sequence's next tokens found in its own text (prompt lookup), and how long to make them.

A reply that quotes its prompt (a document's sentence, code being edited, a JSON object restated) repeats
token runs it has already seen. The draft is what followed the latest earlier occurrence of the sequence's last
few tokens; the engine verifies it in one forward, where a step's weights serve every draft row (see Engine).
Its length adapts to the sequence: it grows while drafts are taken whole, falls to what was taken otherwise,
and a sequence whose drafts miss stops drafting for a few steps, longer each miss in a row.
"""

from __future__ import annotations

from array import array

NGRAM_SIZES = (3, 2)  # the suffix looked up, longest first: one token matches too often to be worth a draft
FIRST_LENGTH = 2  # a sequence's first draft; later ones follow its record
MAX_PAUSE_STEPS = 16  # the longest a sequence goes without a draft after misses in a row


class PromptLookup:
    """One sequence's draft source: its tokens as bytes (searched backwards in C) and its record of drafts taken."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.length = min(FIRST_LENGTH, max_tokens)  # the next draft's length at most
        self.pause = 0  # steps left without a draft
        self.misses = 0  # drafts in a row of which no token was taken
        self.text = bytearray()  # the tokens seen, 4 bytes each

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """At most `limit` (and the current length) tokens that followed the latest earlier occurrence of tokens'
        last NGRAM_SIZES tokens; none while paused or where no such occurrence exists."""
        self._extend(tokens)
        if self.pause:
            self.pause -= 1
            return []
        count = min(limit, self.length)
        if count <= 0:
            return []
        for size in NGRAM_SIZES:
            start = self._follower(size)
            if start is not None:
                return tokens[start : start + count]
        return []

    def record(self, proposed: int, accepted: int) -> None:
        """Learn from a verified draft: `accepted` of its `proposed` tokens were the sequence's next tokens."""
        if accepted == proposed:
            self.length = min(self.max_tokens, self.length + 2)
        else:
            self.length = max(1, accepted + 1)
        self.misses = self.misses + 1 if accepted == 0 else 0
        self.pause = min(MAX_PAUSE_STEPS, (1 << self.misses) - 1)

    def _extend(self, tokens: list[int]) -> None:
        """Add the tokens appended since the last call (a sequence's tokens only ever grow)."""
        seen = len(self.text) // 4
        if seen < len(tokens):
            self.text += array("I", tokens[seen:]).tobytes()

    def _follower(self, size: int) -> int | None:
        """Where the token after the latest earlier occurrence of the last `size` tokens is, or None."""
        length = len(self.text) // 4
        if length <= size:
            return None
        suffix = bytes(self.text[-4 * size :])
        end = 4 * (length - 1)  # the occurrence must end before the last token: a token must follow it
        while (found := self.text.rfind(suffix, 0, end)) >= 0:
            if found % 4 == 0:
                return found // 4 + size
            end = found + len(suffix) - 1  # a match across token boundaries: look left of it
        return None
