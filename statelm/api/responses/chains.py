"""Stored responses, each a record in the annotations of the response-chain session that holds its conversation.

A chain is a session of kind `responses` whose transcript only grows while it is extended: a stored response
records `count`, the number of transcript messages up to its own output, so its id names that prefix of the
transcript even after later responses extend the chain. Records are saved, spilled and resumed with their
session, and every record kept or dropped is a change of the session the manager journals (`annotate`), as a
turn is; this index finds them by id and keeps each key's in creation order for the retention (and tells the session
manager's tally, if it has one, so that the retention holds across a cluster's replicas).
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any

from statelm.sessions.manager import SessionManager
from statelm.sessions.ownership import Principal
from statelm.sessions.session import Session, SessionKind

ANNOTATION = "responses"  # the session annotation that holds a chain's records, by response id


@dataclass(frozen=True)
class ResponseRetention:
    """How many stored responses one key keeps (the oldest dropped past it) and for how long; None: no bound."""

    max_per_key: int | None = 1000
    max_age: float | None = 30 * 86400.0  # seconds


@dataclass(frozen=True)
class StoredResponse:
    """A stored response's record and the session holding its conversation."""

    id: str
    session: Session
    record: dict[str, Any]  # count, created_at, response, input_items

    @property
    def count(self) -> int:
        """Transcript messages up to and including this response's output."""
        return int(self.record["count"])


def records(session: Session) -> dict[str, dict[str, Any]]:
    """A chain session's records, by response id."""
    return session.annotations.setdefault(ANNOTATION, {})


def last_count(session: Session) -> int:
    """The transcript length of the chain's latest stored response (0: none is stored)."""
    return max((int(record["count"]) for record in records(session).values()), default=0)


class ResponseChains:
    """Every stored response by id, and each key's in creation order."""

    def __init__(self, retention: ResponseRetention, manager: SessionManager | None) -> None:
        self.retention = retention
        self.manager = manager  # None: a server without sessions, which stores no response
        self._sessions: dict[str, Session] = {}
        self._by_owner: dict[str, OrderedDict[str, float]] = {}  # owner → response id → created_at, in that order
        self._latest = -math.inf  # the latest time seen (a time before it: the clock was set back)
        if manager is not None:
            manager.reverted.append(self.resync)

    def resume(self, sessions: Iterable[Session]) -> None:
        """Index the records of chain sessions resumed from disk."""
        found = [
            (record["created_at"], rid, session) for session in sessions for rid, record in records(session).items()
        ]
        for created_at, response_id, session in sorted(found, key=lambda entry: entry[0]):
            self._index(response_id, session, created_at)

    def find(self, response_id: str, principal: Principal, now: float) -> StoredResponse | None:
        """The stored response, if principal may see it (another key's is as good as missing) and it has not
        outlived the retention."""
        session = self._sessions.get(response_id)
        if session is None or not principal.may_access(session.owner):
            return None
        self._clock(now)
        max_age = self.retention.max_age
        if max_age is not None and self._by_owner[session.owner][response_id] < now - max_age:
            return None
        return StoredResponse(response_id, session, records(session)[response_id])

    def put(self, session: Session, response_id: str, record: dict[str, Any]) -> None:
        """Store a response in its chain session, dropping the key's oldest past the retention's count."""
        self._annotate(session, response_id, record)
        owned = self._index(response_id, session, record["created_at"])
        limit = self.retention.max_per_key
        for dropped in list(owned)[: max(len(owned) - limit, 0)] if limit is not None else []:
            self.drop(dropped)

    def drop(self, response_id: str) -> Awaitable[object] | None:
        """Forget a stored response (its chain session is left for the caller to tidy); with a tally, its
        acknowledgement, for a caller that answers once the response is counted out on every server."""
        session = self._sessions.pop(response_id, None)
        if session is None:
            return None
        self._annotate(session, response_id, None)
        self._by_owner[session.owner].pop(response_id, None)
        tally = self.manager.tally if self.manager is not None else None
        return tally.forget_responses([response_id]) if tally is not None else None

    def resync(self, session: Session) -> None:
        """Index a chain's records again after its changes were taken back (they could not be saved): a response
        stored in it is forgotten, one dropped from it is back."""
        held = records(session) if session.kind is SessionKind.RESPONSES else {}
        gone = [rid for rid, indexed in self._sessions.items() if indexed is session and rid not in held]
        for response_id in gone:
            del self._sessions[response_id]
            self._by_owner[session.owner].pop(response_id, None)
        back = [rid for rid in held if self._sessions.get(rid) is not session]
        for response_id in back:
            self._index(response_id, session, held[response_id]["created_at"])
        owned = self._by_owner.get(session.owner)
        if back and owned is not None:  # in creation order again
            self._by_owner[session.owner] = OrderedDict(sorted(owned.items(), key=lambda entry: entry[1]))
        tally = self.manager.tally if self.manager is not None else None
        if gone and tally is not None:
            tally.forget_responses(gone)

    def recount(self) -> None:
        """Count every stored response held here with the session manager's tally again (after it lost its count)."""
        tally = self.manager.tally if self.manager is not None else None
        for response_id, session in self._sessions.items() if tally is not None else ():
            tally.note_response(session.owner, response_id, session.id, records(session)[response_id]["created_at"])

    def expired(self, now: float) -> list[str]:
        """Ids of every key's responses older than the retention's age."""
        if self.retention.max_age is None:
            return []
        self._clock(now)
        oldest = now - self.retention.max_age
        return [
            response_id
            for owned in self._by_owner.values()
            for response_id, _ in itertools.takewhile(lambda entry: entry[1] < oldest, owned.items())
        ]

    def _annotate(self, session: Session, response_id: str, record: dict[str, Any] | None) -> None:
        """Keep (None: drop) a record in its chain session's annotations, a journalled change of the session."""
        if self.manager is None:
            raise RuntimeError("responses are stored only on a server with sessions")
        self.manager.annotate(session, ANNOTATION, response_id, record)

    def _clock(self, now: float) -> None:
        """Note the time; if the clock was set back, a response stored 'after' now counts as stored now, so that it
        is kept for the retention's age from now: neither dropped early nor kept until the clock catches up."""
        if now >= self._latest:
            self._latest = now
            return
        for owned in self._by_owner.values():
            for response_id, created_at in owned.items():
                if created_at > now:
                    owned[response_id] = now
        self._latest = now

    def _index(self, response_id: str, session: Session, created_at: float) -> OrderedDict[str, float]:
        self._clock(created_at)
        self._sessions[response_id] = session
        owned = self._by_owner.setdefault(session.owner, OrderedDict())
        owned[response_id] = created_at
        if self.manager is not None and self.manager.tally is not None:  # the retention then holds across servers
            self.manager.tally.note_response(session.owner, response_id, session.id, created_at)
        return owned
