"""Per-key counts kept beyond one server, so that a key's limits hold across servers sharing a state dir.

A single server counts what it holds itself and needs none; the replicas of a cluster share one
(statelm.cluster.ledger) so that a key's sessions and stored responses are counted over all of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from typing import Protocol


class KeyTally(Protocol):
    """Every key's sessions and stored responses over all the servers that share it."""

    async def claim(self, owner: str, session_id: str, limit: int | None) -> bool:
        """Count a new session for owner; False (and not counted) if owner already has limit sessions."""
        ...

    def register(self, owner: str, session_ids: Iterable[str]) -> None:
        """Count sessions that already exist (taken over from the state dir), whatever the limit."""
        ...

    def release(self, session_id: str) -> Awaitable[object]:
        """Stop counting a session that was deleted: done once the result is (awaiting it is optional)."""
        ...

    async def owned(self, owner: str) -> list[str]:
        """Ids of owner's sessions on every server."""
        ...

    def note_response(self, owner: str, response_id: str, session_id: str, created_at: float) -> None:
        """Count a stored response; the key's oldest past the retention are then dropped wherever they are."""
        ...

    def forget_responses(self, response_ids: Iterable[str]) -> Awaitable[object]:
        """Stop counting stored responses that were dropped: done once the result is (awaiting it is optional)."""
        ...
