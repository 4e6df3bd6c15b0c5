"""The sessions the replicas' shared state store holds, for the router to place those no replica holds.

The store is the one every replica's SessionManager reads and writes (statelm.sessions.state_store): by default a
DirectoryStore on `--state-dir`, a file system every replica mounts, in the single server's layout. The router only
asks it which sessions it holds: those with a saved bundle or a journal.
"""

from __future__ import annotations

from typing import Protocol

from statelm.sessions.errors import ID_PATTERN
from statelm.sessions.state_store import Area, StateStore


class SessionStore(Protocol):
    """The sessions a shared store holds, by id."""

    def session_ids(self) -> set[str]:
        """Every session id with a saved copy or a journal in the store."""
        ...

    def has_session(self, session_id: str) -> bool:
        """Whether the store holds anything of that session."""
        ...


class StoredSessions:
    """The sessions of a state store, as the router asks about them."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def session_ids(self) -> set[str]:
        """Ids of the saved sessions and journals (names that are no ids left out)."""
        names = set(self.store.bundle_names(Area.SESSIONS)) | set(self.store.log_names())
        return {name for name in names if ID_PATTERN.fullmatch(name)}

    def has_session(self, session_id: str) -> bool:
        """Whether the session has a saved bundle or a journal (False for anything that is not an id)."""
        if not ID_PATTERN.fullmatch(session_id):
            return False
        return self.store.bundle_exists(Area.SESSIONS, session_id) or self.store.log_exists(session_id)
