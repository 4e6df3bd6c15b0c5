"""Sessions as the last run left them: saved directories, brought up to date by their journals.

For every session id with a saved directory or a journal: the directory gives the KV and the state as of
its log sequence number (lsn); the journal's records newer than that are replayed on top. A journal alone
gives the whole session, and so does one whose first newer record states the whole session (a session
created again with the id of an older one): the directory is then not read. A torn last record is dropped
with one warning and cut off the file. A session whose directory or journal is damaged, or whose
directory (when needed) was made with another model, is skipped with a warning and its files are left
alone. Leftovers are cleaned: temporaries, the files of deleted sessions (a directory a crash left half removed
included), journals their directory has caught up with.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statelm.models.loader import ModelFingerprint
from statelm.sessions.errors import SessionError, check_id
from statelm.sessions.journal import SUFFIX, read_journal, remove_journal, truncate_journal
from statelm.sessions.journal_records import record_lsn, replay, supersedes
from statelm.sessions.session import Session
from statelm.sessions.snapshot_format import MANIFEST, read_manifest, read_transcript
from statelm.sessions.temporaries import clean_temporaries

log = logging.getLogger(__name__)


@dataclass
class Recovered:
    """What the last run left: its sessions, the highest lsn in use, and what the journals contributed."""

    sessions: list[Session] = field(default_factory=list)
    last_lsn: int = 0
    from_journal: int = 0  # sessions whose state needed journal records
    journal_sizes: dict[str, int] = field(default_factory=dict)


def recover_sessions(sessions_dir: Path, journal_dir: Path, fingerprint: ModelFingerprint) -> Recovered:
    """Every session the last run left in sessions_dir and journal_dir, as of its last change."""
    recovered = Recovered()
    sessions_dir.mkdir(parents=True, exist_ok=True)
    clean_temporaries(sessions_dir)
    directories = {entry.name: entry for entry in _entries(sessions_dir) if entry.is_dir()}
    journal_dir.mkdir(parents=True, exist_ok=True)
    clean_temporaries(journal_dir)
    journals = {
        entry.name.removesuffix(SUFFIX): entry for entry in _entries(journal_dir) if entry.name.endswith(SUFFIX)
    }
    for session_id in sorted(directories.keys() | journals.keys()):
        _recover_into(recovered, session_id, directories.get(session_id), journals.get(session_id), fingerprint)
    return recovered


def recover_session(sessions_dir: Path, journal_dir: Path, session_id: str, fingerprint: ModelFingerprint) -> Recovered:
    """One session as of its last change, from its directory and journal alone (nothing else there is touched:
    other processes may be writing beside it); SessionError for an id that is not one."""
    check_id(session_id, "session_id")
    recovered = Recovered()
    directory, journal = sessions_dir / session_id, journal_dir / f"{session_id}{SUFFIX}"
    found_directory = directory if directory.is_dir() else None
    found_journal = journal if journal.is_file() else None
    if found_directory is not None or found_journal is not None:
        _recover_into(recovered, session_id, found_directory, found_journal, fingerprint)
    return recovered


def _recover_into(
    recovered: Recovered, session_id: str, directory: Path | None, journal: Path | None, fingerprint: ModelFingerprint
) -> None:
    """Add one session to recovered, or warn why it is not resumed."""
    try:
        check_id(session_id, "session_id")
        session = _recover_one(session_id, directory, journal, fingerprint, recovered)
    except (SessionError, OSError) as exc:
        log.warning("not resuming session %s: %s", session_id, exc)
        return
    if session is not None:
        recovered.sessions.append(session)


def _recover_one(
    session_id: str, directory: Path | None, journal: Path | None, fingerprint: ModelFingerprint, into: Recovered
) -> Session | None:
    """One session from its directory and journal (either may be None); None if the journal deleted it."""
    records = _journal_records(session_id, journal) if journal is not None else []
    saved_lsn = _saved_lsn(directory, records) if directory is not None else 0
    into.last_lsn = max([into.last_lsn, saved_lsn, *map(record_lsn, records)])
    newer = [record for record in records if record_lsn(record) > saved_lsn]
    session = None
    if directory is not None and not (newer and supersedes(newer[0])):
        session = _read_directory(session_id, directory, fingerprint)
    session = replay(session_id, session, newer)
    if journal is None:
        return session
    if session is None:  # deleted: what the crash left of it goes now
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        remove_journal(journal)
    elif not newer:  # the directory is as new as the journal: only the compaction was missing
        remove_journal(journal)
    else:
        into.from_journal += 1
        into.journal_sizes[session_id] = journal.stat().st_size
        session.disk_stale = True
    return session


def _saved_lsn(directory: Path, records: list[dict[str, Any]]) -> int:
    """The lsn a saved directory is current to.

    A directory without its manifest while the journal states the whole session or its deletion from its first
    record is what a crash left of a deletion (the `delete` record is durable before the directory is removed):
    0, so that the journal alone decides. Any other unreadable manifest is damage (SessionError).
    """
    try:
        return _lsn(read_manifest(directory))
    except SessionError:
        if (directory / MANIFEST).exists() or not (records and supersedes(records[0])):
            raise
        return 0


def _journal_records(session_id: str, journal: Path) -> list[dict[str, Any]]:
    """A journal's records; a torn last record is dropped with a warning and cut off the file."""
    contents = read_journal(journal)
    if contents.torn_bytes:
        log.warning("journal of session %s: dropped a torn last record (%d bytes at byte %d), left by a crash "
                    "mid-append", session_id, contents.torn_bytes, contents.valid_bytes)  # fmt: skip
        truncate_journal(journal, contents.valid_bytes)
    return contents.records


def _read_directory(session_id: str, directory: Path, fingerprint: ModelFingerprint) -> Session:
    """The session a saved directory holds (its KV stays on disk until its next turn)."""
    manifest, transcript = read_transcript(directory, fingerprint)
    session = Session.restored(session_id, manifest.get("session", {}), transcript, manifest.get("created", 0.0))
    session.stored_tokens = int(manifest.get("num_tokens", 0))
    session.on_disk = True
    session.lsn = _lsn(manifest)
    return session


def _lsn(manifest: dict[str, object]) -> int:
    lsn = manifest.get("lsn", 0)
    return lsn if type(lsn) is int else 0


def _entries(root: Path) -> list[Path]:
    """The visible entries of root."""
    return [entry for entry in sorted(root.iterdir()) if not entry.name.startswith(".")]
