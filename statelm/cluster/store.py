"""The state store every replica shares: which sessions it holds, for the router to place those no replica holds.

The default is a directory (`--state-dir` on a filesystem every replica mounts) in the single server's layout:
`sessions/<id>/` (snapshot format), `journal/<id>.journal`, `snapshots/<id>/`. Replicas read and write it through
their SessionManager as a single server does; an object store would implement this protocol and that I/O.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from statelm.sessions.errors import ID_PATTERN
from statelm.sessions.journal import SUFFIX


class SessionStore(Protocol):
    """The sessions a shared store holds, by id."""

    def session_ids(self) -> set[str]:
        """Every session id with a saved copy or a journal in the store."""
        ...

    def has_session(self, session_id: str) -> bool:
        """Whether the store holds anything of that session."""
        ...


class DirectoryStore:
    """A shared state directory in the single server's layout."""

    def __init__(self, root: Path) -> None:
        self.sessions_dir = root / "sessions"
        self.journal_dir = root / "journal"

    def session_ids(self) -> set[str]:
        """Ids of the session directories and journals (temporaries and names that are no ids left out)."""
        names = {entry.name for entry in _entries(self.sessions_dir) if entry.is_dir()}
        names |= {entry.name.removesuffix(SUFFIX) for entry in _entries(self.journal_dir) if entry.suffix == SUFFIX}
        return {name for name in names if ID_PATTERN.fullmatch(name)}

    def has_session(self, session_id: str) -> bool:
        """Whether the session has a directory or a journal (False for anything that is not an id)."""
        if not ID_PATTERN.fullmatch(session_id):
            return False
        return (self.sessions_dir / session_id).is_dir() or (self.journal_dir / f"{session_id}{SUFFIX}").is_file()


def _entries(directory: Path) -> list[Path]:
    return list(directory.iterdir()) if directory.is_dir() else []
