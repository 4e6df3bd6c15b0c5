"""Sessions as the last run left them: saved bundles, brought up to date by their journals.

For every session id with a saved bundle (the state store's SESSIONS area) or a journal: the bundle gives the KV and
the state as of its log sequence number (lsn); the journal's records newer than that are replayed on top. A journal
alone gives the whole session, and so does one whose first newer record states the whole session (a session created
again with the id of an older one): the bundle is then not read. A torn last record is dropped with one warning and
cut off the journal. A session whose bundle or journal is damaged, or whose bundle (when needed) was made with another
model, is skipped with a warning and left alone. Leftovers are cleaned: what writers that died left half done, what is
left of deleted sessions (a bundle a crash left half removed included), journals their bundle has caught up with.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from statelm.models.loader import ModelFingerprint
from statelm.sessions.errors import SessionError, SnapshotCorruptError, check_id
from statelm.sessions.journal import decode_journal
from statelm.sessions.journal_records import flatten, record_lsn, replay, supersedes
from statelm.sessions.session import Session
from statelm.sessions.snapshot_format import read_manifest, read_transcript
from statelm.sessions.state_store import Area, StateStore

log = logging.getLogger(__name__)


@dataclass
class Recovered:
    """What the last run left: its sessions, the highest lsn in use, and what the journals contributed."""

    sessions: list[Session] = field(default_factory=list)
    last_lsn: int = 0
    from_journal: int = 0  # sessions whose state needed journal records
    journal_sizes: dict[str, int] = field(default_factory=dict)


def recover_sessions(store: StateStore, fingerprint: ModelFingerprint) -> Recovered:
    """Every session the last run left in store, as of its last change."""
    recovered = Recovered()
    store.prepare(Area.SESSIONS, exclusive=True)
    saved = set(store.bundle_names(Area.SESSIONS))
    store.prepare(Area.JOURNAL, exclusive=True)
    journalled = set(store.log_names())
    for session_id in sorted(saved | journalled):
        _recover_into(recovered, store, session_id, session_id in saved, session_id in journalled, fingerprint)
    return recovered


def recover_session(store: StateStore, session_id: str, fingerprint: ModelFingerprint) -> Recovered:
    """One session as of its last change, from its bundle and journal alone (nothing else there is touched:
    other processes may be writing beside it); SessionError for an id that is not one."""
    check_id(session_id, "session_id")
    recovered = Recovered()
    saved, journalled = store.bundle_exists(Area.SESSIONS, session_id), store.log_exists(session_id)
    if saved or journalled:
        _recover_into(recovered, store, session_id, saved, journalled, fingerprint)
    return recovered


def _recover_into(
    recovered: Recovered,
    store: StateStore,
    session_id: str,
    saved: bool,
    journalled: bool,
    fingerprint: ModelFingerprint,
) -> None:
    """Add one session to recovered, or warn why it is not resumed."""
    try:
        check_id(session_id, "session_id")
        session = _recover_one(store, session_id, saved, journalled, fingerprint, recovered)
    except (SessionError, OSError) as exc:
        log.warning("not resuming session %s: %s", session_id, exc)
        return
    if session is not None:
        recovered.sessions.append(session)


def _recover_one(
    store: StateStore,
    session_id: str,
    saved: bool,
    journalled: bool,
    fingerprint: ModelFingerprint,
    into: Recovered,
) -> Session | None:
    """One session from its saved bundle and journal (either may be missing); None if the journal deleted it."""
    records = _journal_records(store, session_id) if journalled else []
    saved_lsn = _saved_lsn(store, session_id, records) if saved else 0
    into.last_lsn = max([into.last_lsn, saved_lsn, *map(record_lsn, records)])
    newer = [record for record in records if record_lsn(record) > saved_lsn]
    session = None
    if saved and not (newer and supersedes(newer[0])):
        session = _read_saved(store, session_id, fingerprint)
    session = replay(session_id, session, newer)
    if not journalled:
        return session
    if session is None:  # deleted: what the crash left of it goes now
        if saved:
            with contextlib.suppress(OSError):
                store.delete_bundle(Area.SESSIONS, session_id)
        store.remove_log(session_id)
    elif not newer:  # the bundle is as new as the journal: only the compaction was missing
        store.remove_log(session_id)
    else:
        into.from_journal += 1
        into.journal_sizes[session_id] = store.log_size(session_id)
        session.disk_stale = True
    return session


def _saved_lsn(store: StateStore, session_id: str, records: list[dict[str, Any]]) -> int:
    """The lsn a saved bundle is current to.

    A bundle without its manifest while the journal states the whole session or its deletion from its first record
    is what a crash left of a deletion (the `delete` record is durable before the bundle is removed): 0, so that the
    journal alone decides. Any other unreadable manifest is damage (SessionError).
    """
    try:
        return _lsn(read_manifest(store, Area.SESSIONS, session_id))
    except SnapshotCorruptError as exc:
        manifest_missing = isinstance(exc.__cause__, FileNotFoundError)
        if not (manifest_missing and records and supersedes(records[0])):
            raise
        return 0


def _journal_records(store: StateStore, session_id: str) -> list[dict[str, Any]]:
    """A journal's records; a torn last record is dropped with a warning and cut off the journal."""
    contents = decode_journal(store.read_log(session_id))
    if contents.torn_bytes:
        log.warning("journal of session %s: dropped a torn last record (%d bytes at byte %d), left by a crash "
                    "mid-append", session_id, contents.torn_bytes, contents.valid_bytes)  # fmt: skip
        store.truncate_log(session_id, contents.valid_bytes)
    return flatten(contents.records)


def _read_saved(store: StateStore, session_id: str, fingerprint: ModelFingerprint) -> Session:
    """The session a saved bundle holds (its KV stays in the store until its next turn)."""
    manifest, transcript = read_transcript(store, Area.SESSIONS, session_id, fingerprint)
    session = Session.restored(session_id, manifest.get("session", {}), transcript, manifest.get("created", 0.0))
    session.stored_tokens = int(manifest.get("num_tokens", 0))
    session.on_disk = True
    session.lsn = _lsn(manifest)
    return session


def _lsn(manifest: dict[str, object]) -> int:
    lsn = manifest.get("lsn", 0)
    return lsn if type(lsn) is int else 0
