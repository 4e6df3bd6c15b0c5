"""What a session journal's records say: made when a session changes, replayed onto it at recovery.

Every record carries `lsn`, the log sequence number of the change: numbers grow across all sessions and
runs, and a session's saved directory records the number it is current to, so recovery replays exactly
the records newer than the directory (a crash between writing the directory and compacting the journal
leaves older records behind, which are skipped).

```
{"type": "session",    "lsn", "session": {id, created, last_used, owner, kind, annotations, settings…},
                        "transcript": [...]}
{"type": "turn",       "lsn", "time", "messages": [...]}     messages appended by a completed turn
{"type": "rollback",   "lsn", "time", "keep_messages": n}
{"type": "annotation", "lsn", "name", "key", "value"}       annotations[name][key] set (value null: removed)
{"type": "delete",     "lsn"}
{"type": "batch",      "lsn", "records": [...]}             changes made together (by one request): all or none
```

A `session` record states the whole session (creation, fork, snapshot load, or a journal rewritten after
a failed write); the others change the session before them. An `annotation` record is a change of what the
API a session belongs to keeps with it: a response chain's stored response kept or dropped. A `batch` record holds
the changes of one session made in one step of the event loop (a turn and the response it stored), so that they are
written, torn and replayed together; its `lsn` is its last record's, and recovery reads its records as if each stood
alone (`flatten`), so a saved directory current to one of them has only the later ones replayed. The KV is not in
the journal: a recovered session's KV is whatever its directory holds, and its next turn recomputes the rest
by longest common prefix of token ids.
"""

from __future__ import annotations

from typing import Any

from statelm.sessions.journal import JournalCorruptError
from statelm.sessions.session import Session

SESSION, TURN, ROLLBACK, ANNOTATION, DELETE, BATCH = "session", "turn", "rollback", "annotation", "delete", "batch"


def session_record(session: Session) -> dict[str, Any]:
    """The whole session as one record."""
    return {"type": SESSION, "lsn": session.lsn, **session.manifest_fields(), "transcript": session.transcript}


def turn_record(session: Session, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A completed turn's messages (the turn's own and the reply)."""
    return {"type": TURN, "lsn": session.lsn, "time": session.last_used, "messages": messages}


def rollback_record(session: Session, keep_messages: int) -> dict[str, Any]:
    """The transcript cut to its first keep_messages messages."""
    return {"type": ROLLBACK, "lsn": session.lsn, "time": session.last_used, "keep_messages": keep_messages}


def annotation_record(session: Session, name: str, key: str, value: dict[str, Any] | None) -> dict[str, Any]:
    """One entry of one of the session's annotations set to value (None: removed)."""
    return {"type": ANNOTATION, "lsn": session.lsn, "name": name, "key": key, "value": value}


def delete_record(lsn: int) -> dict[str, Any]:
    """The session deleted."""
    return {"type": DELETE, "lsn": lsn}


def batch_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Changes (none stating the whole session) written as one record."""
    return {"type": BATCH, "lsn": records[-1]["lsn"], "records": records}


def flatten(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A journal's records with each batch replaced by the records it holds."""
    flat: list[dict[str, Any]] = []
    for record in records:
        if record.get("type") != BATCH:
            flat.append(record)
            continue
        held = record.get("records")
        if not (isinstance(held, list) and held and all(map(_is_change, held))):
            raise JournalCorruptError("a batch record does not hold a list of changes")
        flat.extend(held)
    return flat


def _is_change(record: object) -> bool:
    """Whether a record changes a session (rather than stating it whole, deleting it, or holding others)."""
    return isinstance(record, dict) and record.get("type") in (TURN, ROLLBACK, ANNOTATION)


def record_lsn(record: dict[str, Any]) -> int:
    """A record's log sequence number."""
    lsn = record.get("lsn")
    if type(lsn) is not int or lsn < 1:
        raise JournalCorruptError(f"a {record.get('type')!r} record has no valid lsn")
    return lsn


def replay(session_id: str, session: Session | None, records: list[dict[str, Any]]) -> Session | None:
    """session (None: nothing before the records) after the records, in order; None if they delete it."""
    for record in records:
        session = _apply(session_id, session, record)
        if session is not None:
            session.lsn = record_lsn(record)
    return session


def supersedes(record: dict[str, Any]) -> bool:
    """Whether a record states the whole session, so that nothing before it matters."""
    return record.get("type") in (SESSION, DELETE)


def _apply(session_id: str, session: Session | None, record: dict[str, Any]) -> Session | None:
    kind = record.get("type")
    if kind == SESSION:
        fields = record.get("session")
        if not isinstance(fields, dict):
            raise JournalCorruptError("a session record has no session section")
        return Session.restored(session_id, fields, list(_messages(record.get("transcript"))))
    if kind == DELETE:
        return None
    if session is None:
        raise JournalCorruptError(f"a {kind!r} record follows no session")
    if kind == TURN:
        session.transcript.extend(_messages(record.get("messages")))
    elif kind == ROLLBACK:
        keep = record.get("keep_messages")
        if type(keep) is not int or not 0 <= keep <= len(session.transcript):
            raise JournalCorruptError(f"a rollback record keeps {keep!r} of {len(session.transcript)} messages")
        del session.transcript[keep:]
    elif kind == ANNOTATION:
        _annotate(session, record)
    else:
        raise JournalCorruptError(f"unknown record type {kind!r}")
    time = record.get("time")
    if isinstance(time, int | float):
        session.last_used = time
    return session


def _annotate(session: Session, record: dict[str, Any]) -> None:
    name, key, value = record.get("name"), record.get("key"), record.get("value")
    if not (isinstance(name, str) and isinstance(key, str) and (value is None or isinstance(value, dict))):
        raise JournalCorruptError("an annotation record has no name, key or object value")
    entries = session.annotations.setdefault(name, {})
    if not isinstance(entries, dict):
        raise JournalCorruptError(f"an annotation record changes annotation {name!r}, which is not an object")
    if value is None:
        entries.pop(key, None)
    else:
        entries[key] = value


def _messages(value: Any) -> list[dict[str, Any]]:
    if not (isinstance(value, list) and all(isinstance(message, dict) for message in value)):
        raise JournalCorruptError("a record's messages are not a list of objects")
    return value
