"""The cluster's count of every key's sessions and stored responses, so that --max-sessions-per-key,
--max-stored-responses and the journal share of --snapshot-quota hold across the replicas as on one server.

`KeyLedger` is one Ray actor (its calls run one at a time, so a claim is atomic); each replica reaches it through a
`LedgerTally`, the `KeyTally` its session manager and response chains count through. The ledger is a cache of what
the replicas and the shared store hold, like the router's affinity table: the router drops entries of sessions that
are gone (a replica that died with sessions it never saved) each time it has orphans adopted, and when Ray restarts
the ledger (empty, a new incarnation) the router has every live replica count what it holds again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ray.exceptions import RayError

log = logging.getLogger(__name__)
CLAIM_GRACE_S = 60.0  # a session claimed this recently may not be in the store or a replica's table yet


class KeyLedger:
    """Every key's session ids and stored response ids, over the whole cluster."""

    def __init__(self) -> None:
        self.incarnation = uuid.uuid4().hex  # a restarted ledger (empty) has a new one
        self._owners: dict[str, str] = {}  # session id → owner
        self._claimed: dict[str, float] = {}  # session id → when it was counted (monotonic: clock jumps do not count)
        self._sessions: dict[str, set[str]] = {}  # owner → session ids
        self._responses: dict[str, dict[str, tuple[float, str]]] = {}  # owner → response id → (created_at, session)

    def current_incarnation(self) -> str:
        """Which start of the ledger this is."""
        return self.incarnation

    def claim(self, owner: str, session_id: str, limit: int | None) -> bool:
        """Count a new session unless owner has limit sessions already (an id counted already counts as claimed)."""
        if session_id in self._owners:
            return True
        if limit is not None and len(self._sessions.get(owner, ())) >= limit:
            return False
        self._add(owner, session_id)
        return True

    def register(self, owner: str, session_ids: list[str]) -> None:
        """Count existing sessions, whatever the limit."""
        for session_id in session_ids:
            if session_id not in self._owners:
                self._add(owner, session_id)

    def release(self, session_id: str) -> None:
        """Stop counting a session and the responses it held."""
        owner = self._owners.pop(session_id, None)
        if owner is None:
            return
        self._claimed.pop(session_id, None)
        self._sessions[owner].discard(session_id)
        responses = self._responses.get(owner, {})
        for response_id in [rid for rid, (_, held_by) in responses.items() if held_by == session_id]:
            del responses[response_id]

    def owned(self, owner: str) -> list[str]:
        """owner's session ids."""
        return sorted(self._sessions.get(owner, ()))

    def add_response(
        self, owner: str, response_id: str, session_id: str, created_at: float, limit: int | None
    ) -> list[str]:
        """Count a stored response; the ids of owner's oldest past limit, no longer counted, for their replicas to
        drop."""
        responses = self._responses.setdefault(owner, {})
        responses[response_id] = (created_at, session_id)
        if limit is None or len(responses) <= limit:
            return []
        oldest = sorted(responses, key=lambda rid: responses[rid][0])[: len(responses) - limit]
        for dropped in oldest:
            del responses[dropped]
        return oldest

    def forget_responses(self, response_ids: list[str]) -> None:
        """Stop counting stored responses."""
        for responses in self._responses.values():
            for response_id in response_ids:
                responses.pop(response_id, None)

    def retain(self, present: set[str], grace_s: float = CLAIM_GRACE_S) -> int:
        """Stop counting sessions neither present (in the store or held by a live replica) nor claimed within
        grace_s; how many."""
        now = time.monotonic()
        gone = [sid for sid in self._owners if sid not in present and self._claimed.get(sid, 0.0) < now - grace_s]
        for session_id in gone:
            self.release(session_id)
        return len(gone)

    def _add(self, owner: str, session_id: str) -> None:
        self._owners[session_id] = owner
        self._claimed[session_id] = time.monotonic()
        self._sessions.setdefault(owner, set()).add(session_id)


class LedgerTally:
    """A replica's way to the ledger: the KeyTally its sessions and stored responses are counted through."""

    def __init__(
        self, ledger: Any, response_limit: int | None, drop_everywhere: Callable[[list[str]], Awaitable[None]]
    ) -> None:
        self.ledger = ledger  # the KeyLedger actor's handle
        self.response_limit = response_limit
        self.drop_everywhere = drop_everywhere  # has every replica drop those stored responses
        self._tasks: set[asyncio.Task[None]] = set()

    async def claim(self, owner: str, session_id: str, limit: int | None) -> bool:
        """Count a new session for owner; False if owner has limit sessions in the cluster."""
        return bool(await self.ledger.claim.remote(owner, session_id, limit))

    def register(self, owner: str, session_ids: Iterable[str]) -> None:
        """Count sessions taken over from the store."""
        self.ledger.register.remote(owner, list(session_ids))

    def release(self, session_id: str) -> Awaitable[object]:
        """Stop counting a deleted session (the call, to await for its end)."""
        return self.ledger.release.remote(session_id)

    async def owned(self, owner: str) -> list[str]:
        """owner's session ids in the cluster."""
        return list(await self.ledger.owned.remote(owner))

    def note_response(self, owner: str, response_id: str, session_id: str, created_at: float) -> None:
        """Count a stored response; the key's oldest past the retention are dropped on whichever replica holds
        them, in the background."""
        dropped = self.ledger.add_response.remote(owner, response_id, session_id, created_at, self.response_limit)
        task = asyncio.get_running_loop().create_task(self._drop(dropped))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def forget_responses(self, response_ids: Iterable[str]) -> Awaitable[object]:
        """Stop counting dropped responses (the call, to await for its end)."""
        return self.ledger.forget_responses.remote(list(response_ids))

    async def _drop(self, dropped: Awaitable[list[str]]) -> None:
        try:
            response_ids = await dropped
            if response_ids:
                await self.drop_everywhere(response_ids)
        except RayError as exc:
            log.warning("could not apply the stored-response retention across the cluster: %s", exc)
