"""Sessions on the event loop's side: create, list, turn bookkeeping, fork, rollback, spill, persist, snapshot.

The engine owns the KV; this manager owns transcripts and settings, moves KV
between the pool and the state store (statelm.sessions.state_store), and journals every change of a session
(statelm.sessions.journal_store). Blocking store I/O runs in worker threads; engine work goes through the
EngineClient, which runs it in order between steps.

Durable or refused: a change is made in memory at once, journalled, and answered once its record is durable
(`settled`). If the record cannot be written (a full, read-only or vanished state store), the change is taken back,
with every change of the session made after it, and whoever waits on it gets StorageError (507): the session is as it
was before. A creation and a deletion wait for their record before they go on. The manager looks at the store now and
then: it reports its condition (statelm.sessions.storage), remakes a state directory that vanished, and once the
store takes writes again rewrites the journals that failed writes left broken and writes the spills that could not
be written.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from statelm.config import SessionDurability
from statelm.engine.client import EngineClient, SessionKVData, SessionKVError
from statelm.models.loader import ModelFingerprint
from statelm.sessions.errors import (
    AlreadyExistsError,
    NotFoundError,
    SessionBusyError,
    SessionError,
    SessionLimitError,
    check_id,
)
from statelm.sessions.journal_records import annotation_record, rollback_record, session_record, turn_record
from statelm.sessions.journal_store import JournalCounters, Outcome, SessionJournal
from statelm.sessions.keyed_locks import KeyedLocks
from statelm.sessions.ownership import current_principal
from statelm.sessions.recovery import Recovered, recover_session, recover_sessions
from statelm.sessions.session import Session, SessionKind, SessionSettings, SessionState
from statelm.sessions.snapshot_format import SnapshotContent, read_snapshot, write_snapshot
from statelm.sessions.snapshots import SnapshotStore
from statelm.sessions.state_store import Area, StateStore
from statelm.sessions.storage import StorageCondition, StorageError, StorageHealth, StoreSpace, cause_of
from statelm.sessions.tally import KeyTally

log = logging.getLogger(__name__)
IDLE_CHECK_MAX_S = 5.0  # the longest an idle session waits past --persist-idle-after to be saved
STORAGE_CHECK_S = 1.0  # how often the state store's condition is looked at (and what it is owed paid)
T = TypeVar("T")


@dataclass(frozen=True)
class SessionLimits:
    """What one key may hold: sessions, and bytes of snapshots in the store (None: no limit)."""

    max_sessions_per_key: int | None = None
    snapshot_quota: int | None = None


@dataclass
class _Unconfirmed:
    """A change of a session whose journal record is not known durable yet: the write's outcome, and its undo."""

    outcome: asyncio.Future[Outcome]
    undo: Callable[[], None]
    session: Session


@dataclass
class SessionView:
    """A session with the figures that depend on the engine: token count and state."""

    session: Session
    num_tokens: int
    state: SessionState


def new_session_id() -> str:
    """A fresh session id."""
    return f"sess-{uuid.uuid4().hex[:24]}"


class SessionManager:
    """All sessions of the server, and the snapshot store.

    Every operation acts for the current principal (statelm.sessions.ownership): a session another key owns
    is reported as missing, new sessions record the caller as their owner, and the caller's limits apply.
    Sessions of one kind are invisible to operations on the other (a response chain is no sessions API session).
    """

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        fingerprint: ModelFingerprint,
        store: StateStore,
        durability: SessionDurability,
        limits: SessionLimits | None = None,
        journal_counters: JournalCounters | None = None,
        resume: bool = True,
        tally: KeyTally | None = None,
        persist_idle_after: float | None = None,
        storage_check_s: float = STORAGE_CHECK_S,
    ) -> None:
        self.engine = engine
        self.store = store
        self.resume = resume  # take every session the store holds at start (else share it, adopting some)
        self.limits = limits or SessionLimits()
        self.tally = tally  # counts every key's sessions beyond this server (a cluster's replicas), if any
        self.model_name = model_name
        self.fingerprint = fingerprint
        self.persist = durability is not SessionDurability.OFF
        self.sessions: dict[str, Session] = {}
        self.saved = store if self.persist else store.private()  # where sessions are saved and spilled
        self.journal = (
            SessionJournal(store, durability is SessionDurability.TURN, journal_counters) if self.persist else None
        )
        self._last_lsn = 0  # log sequence number of the latest change of any session
        self.snapshots = SnapshotStore(store, model_name, fingerprint, exclusive=resume)
        self._disk_locks = KeyedLocks()  # by session id: one writer of a session's saved bundle at a time
        self._quota_locks = KeyedLocks()  # by owner: one snapshot at a time checks and uses a key's quota
        self._writes: set[asyncio.Task[None]] = set()
        self.persist_idle_after = persist_idle_after if self.persist else None  # seconds; None: no idle saves
        self._idle_saver: asyncio.Task[None] | None = None
        self._changed_at: dict[str, float] = {}  # monotonic time of each session's last change (for idle saves)
        self._started_at = time.monotonic()
        self._unconfirmed: dict[str, list[_Unconfirmed]] = {}  # by session id, in the order made
        self.reverted: list[Callable[[Session], None]] = []  # told of a session whose changes were taken back
        self.health = StorageHealth(StoreSpace(str(store), StorageCondition.OK))
        self._unwritten_spills: set[str] = set()  # sessions whose spilled KV could not be written (kept in memory)
        self.storage_check_s = storage_check_s
        self._storage_watch: asyncio.Task[None] | None = None
        self._failed_with_free = -1  # free bytes when the owed writes last failed
        self._remake_failed = False  # whether remaking a vanished store failed (logged once)

    async def start(self) -> None:
        """Take spilled KV from the engine from now on, and resume the sessions the last run left."""
        self.engine.on_spill(self._spilled)
        if self.journal is None:  # nothing is kept: spills go to a private store, removed at close
            await asyncio.to_thread(self.saved.prepare, Area.SESSIONS, True)
        elif self.resume:
            await self._resume(self.journal)
        else:  # what other servers sharing the store write stays; what dead ones left goes
            for area in (Area.SESSIONS, Area.JOURNAL):
                await asyncio.to_thread(self.saved.prepare, area, False)
        if self.persist_idle_after is not None:
            self._idle_saver = asyncio.create_task(self._save_idle_sessions(self.persist_idle_after))
        self.health.observe(await asyncio.to_thread(self.store.space), 0)
        self._storage_watch = asyncio.create_task(self._watch_storage(self.storage_check_s))

    async def _save_idle_sessions(self, idle_after: float) -> None:
        """Save every session changed since its last save and idle for idle_after seconds, as they become so (by the
        monotonic clock: a wall clock set back delays no save)."""
        period = min(max(idle_after / 4, 0.1), IDLE_CHECK_MAX_S)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                changed_at = self._changed_at.get(session.id, self._started_at)
                if session.disk_stale and not session.busy and now - changed_at >= idle_after:
                    try:
                        await self._save(session)
                    except (OSError, SessionError) as exc:
                        log.error("could not save idle session %s: %s", session.id, exc)

    async def _resume(self, journal: SessionJournal) -> None:
        """Take in the sessions the last run left, each as of its last change."""
        started = time.perf_counter()
        log.info("resuming the sessions the last run left in %s", self.saved)
        found = await asyncio.to_thread(recover_sessions, self.saved, self.fingerprint)
        self._take(found, journal)
        if found.sessions:
            log.info("resumed %d sessions (%d brought up to date by their journals) in %.0f ms",
                     len(found.sessions), found.from_journal, (time.perf_counter() - started) * 1000)  # fmt: skip

    async def adopt(self, session_ids: Iterable[str]) -> list[Session]:
        """Take over sessions that another server left in the store, each as of its last change (its saved bundle
        and journal); ids already held, missing or unreadable are skipped. The caller ensures nobody else holds them.
        """
        adopted: list[Session] = []
        journal = self.journal
        if journal is None:
            return adopted
        for session_id in session_ids:
            if session_id in self.sessions:
                continue
            try:
                found = await asyncio.to_thread(recover_session, self.saved, session_id, self.fingerprint)
            except SessionError as exc:
                log.warning("not adopting session %s: %s", session_id, exc)
                continue
            self._take(found, journal)
            adopted.extend(found.sessions)
        self._register(adopted)
        return adopted

    def recount(self) -> None:
        """Count every session held here with the tally again (after the tally lost its count)."""
        self._register(list(self.sessions.values()))

    def _register(self, sessions: list[Session]) -> None:
        if self.tally is not None:
            for owner in {session.owner for session in sessions}:
                self.tally.register(owner, [session.id for session in sessions if session.owner == owner])

    def _take(self, found: Recovered, journal: SessionJournal) -> None:
        """Hold recovered sessions; later changes get log sequence numbers above any they had."""
        self.sessions.update((session.id, session) for session in found.sessions)
        self._last_lsn = max(self._last_lsn, found.last_lsn)
        journal.sizes.update(found.journal_sizes)
        journal.counters.recoveries += found.from_journal

    async def close(self) -> None:
        """Save every session (when persisting) or remove the private spill store; the engine must still run."""
        self.engine.on_spill(None)
        for task in (self._idle_saver, self._storage_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        if not self.persist:
            await asyncio.to_thread(self.saved.destroy)
            return
        saved = 0
        for session in list(self.sessions.values()):
            try:
                saved += await self._save(session)
            except (OSError, SessionError) as exc:
                log.error("could not save session %s: %s", session.id, exc)
        log.info("saved %d sessions to %s", saved, self.saved)
        if self.journal is not None:
            await self.journal.close()

    # --- session CRUD -------------------------------------------------------------------------------

    async def create(
        self,
        session_id: str | None,
        settings: SessionSettings,
        transcript: list[dict[str, Any]] | None = None,
        kind: SessionKind = SessionKind.SESSION,
        annotations: dict[str, Any] | None = None,
        replacing: Session | None = None,
    ) -> Session:
        """A new session of kind owned by the caller: with transcript, or empty but for the system message if given,
        and annotations; returned once its creation is durable (StorageError if it cannot be: no session is made).

        With replacing (an idle session of that id), the new session takes its place in one durable step (its record
        replaces the journal whole): if that fails, replacing stays as it was.

        Sessions of every kind count toward the caller's limit: on this server, and with a tally on every server
        that shares it.
        """
        session_id = check_id(session_id, "session_id") if session_id is not None else new_session_id()
        if replacing is not None:
            self._idle(session_id)
            del self.sessions[session_id]
            released = self._untally(session_id)
            if released is not None:
                await released
        try:
            return await self._make(session_id, settings, transcript, kind, annotations or {}, replacing)
        except BaseException:
            if replacing is not None and session_id not in self.sessions:
                self.sessions[session_id] = replacing
                self._register([replacing])
            raise

    async def _make(
        self,
        session_id: str,
        settings: SessionSettings,
        transcript: list[dict[str, Any]] | None,
        kind: SessionKind,
        annotations: dict[str, Any],
        replacing: Session | None,
    ) -> Session:
        self._check_new(session_id)
        owner = current_principal().owner
        limit = self.limits.max_sessions_per_key
        if limit is not None and sum(session.owner == owner for session in self.sessions.values()) >= limit:
            raise _limit_error(limit)
        if self.tally is not None:
            if not await self.tally.claim(owner, session_id, limit):
                raise _limit_error(limit)
            self._check_new(session_id)  # made by another request while this one waited
        if transcript is None:
            transcript = [{"role": "system", "content": settings.system}] if settings.system is not None else []
        session = Session(session_id, settings, transcript, owner=owner, kind=kind, annotations=annotations)
        self.sessions[session_id] = session
        session.busy = True  # no turn starts on it before it exists for good
        try:
            self._changed(session, None, partial(self._unmake, session, replacing is not None))
            await self.settled(session, f"the new session {session_id!r}")
        finally:
            session.busy = False
        return session

    def _unmake(self, session: Session, replacing: bool) -> None:
        """Take back the creation of a session whose record could not be written, and the journal the write may have
        left (unless it replaced another session's, which is then rewritten as that session)."""
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
            self._untally(session.id)
            if self.journal is not None and not replacing:
                self.journal.discard(session.id)

    def _check_new(self, session_id: str) -> None:
        if session_id in self.sessions:
            raise AlreadyExistsError(f"session {session_id!r} already exists", param="session_id")

    def get(self, session_id: str, kind: SessionKind = SessionKind.SESSION) -> Session:
        """The session of that kind with that id, if the caller may see it."""
        session = self.sessions.get(check_id(session_id, "session_id"))
        if session is None or session.kind != kind or not current_principal().may_access(session.owner):
            raise NotFoundError(f"session {session_id!r} does not exist", param="session_id")
        return session

    def visible(self, kind: SessionKind = SessionKind.SESSION) -> list[Session]:
        """The sessions of that kind the caller may see, least recently used first."""
        principal = current_principal()
        sessions = [
            session
            for session in self.sessions.values()
            if session.kind == kind and principal.may_access(session.owner)
        ]
        return sorted(sessions, key=lambda session: session.last_used)

    async def view(self, sessions: list[Session]) -> list[SessionView]:
        """Token counts and states of sessions, as the engine holds them now."""
        resident = await self.engine.resident_sessions([session.id for session in sessions])
        views = []
        for session in sessions:
            in_pool = session.id in resident or not (session.on_disk or session.spilled_kv)
            tokens = resident.get(session.id, 0 if in_pool else session.stored_tokens)
            views.append(SessionView(session, tokens, session.state(in_pool)))
        return views

    async def delete(self, session_id: str, kind: SessionKind = SessionKind.SESSION) -> None:
        """Forget a session, its KV, its saved bundle and its journal, which first records the deletion durably: if it
        cannot (turn durability), StorageError and the session stays as it was."""
        session = self._idle(session_id, kind)
        lsn = self._next_lsn()
        if self.journal is not None:
            session.busy = True
            try:
                outcome = self.journal.delete(session.id, lsn)
                self._track(session, outcome, _nothing)
                error = await self._written(session, outcome)
            finally:
                session.busy = False
            if error is not None and self.journal.appending:
                raise await self._refusal(f"the deletion of session {session_id!r}", error)
        del self.sessions[session.id]
        self._changed_at.pop(session.id, None)
        self._unwritten_spills.discard(session.id)
        released = self._untally(session.id)
        self.engine.release_session_kv(session.id)
        async with self._disk_locks.hold(session.id):
            await asyncio.to_thread(self._delete_saved, session.id)
        if self.journal is not None:
            self.journal.forget(session.id, lsn)
        if released is not None:
            await released  # out of the key's count on every server before the deletion is answered

    def rollback(self, session_id: str, keep_messages: int, kind: SessionKind = SessionKind.SESSION) -> Session:
        """Cut the transcript to its first keep_messages messages; the KV is trimmed by LCP on the next turn."""
        session = self._idle(session_id, kind)
        if keep_messages > len(session.transcript):
            raise SessionError(
                f"keep_messages is {keep_messages} but the session has {len(session.transcript)} messages",
                param="keep_messages",
            )
        transcript, last_used = session.transcript, session.last_used

        def undo() -> None:
            session.transcript, session.last_used = transcript, last_used

        session.transcript = session.transcript[:keep_messages]
        session.touch()
        self._changed(session, lambda changed: rollback_record(changed, keep_messages), undo)
        return session

    async def fork(self, session_id: str, child_id: str | None, annotations: dict[str, Any] | None = None) -> Session:
        """A new session with the parent's transcript (and annotations), sharing its KV blocks (copied on write)."""
        parent = self._idle(session_id)
        settings = SessionSettings.from_dict(parent.settings.to_dict())
        transcript = [dict(message) for message in parent.transcript]
        parent.busy = True
        try:
            child = await self.create(child_id, settings, transcript, annotations=annotations)
            child.busy = True
            try:
                if not await self.engine.fork_session_kv(parent.id, child.id):
                    data = await self._kv_outside_pool(parent)
                    if data is not None:
                        self._hold_spilled(child, data)
            finally:
                child.busy = False
        finally:
            parent.busy = False
        return child

    # --- turns --------------------------------------------------------------------------------------

    def begin_turn(self, session_id: str, kind: SessionKind = SessionKind.SESSION) -> Session:
        """Mark a session busy for a turn; SessionBusyError if a turn already runs."""
        session = self._idle(session_id, kind)
        session.busy = True
        session.touch()
        return session

    async def kv_to_restore(self, session: Session) -> SessionKVData | None:
        """The session's KV if it is outside the pool (spilled), for the turn to load; None if resident."""
        if await self.engine.resident_sessions([session.id]):
            return None
        data = await self._kv_outside_pool(session)
        if data is not None:
            await self._pin_host_memory(data)
        return data

    def end_turn(self, session: Session | None, request_id: str, messages: list[dict[str, Any]] | None) -> None:
        """Commit a completed turn (its messages and KV) into session or, with messages None, drop it; never awaits.

        A turn may read one session's KV and commit into another (a branch); session None commits nothing. The
        session stays busy until the turn's journal record is written (`settled`); if it cannot be, the turn's
        messages are taken back (its KV stays: the next turn keeps what the transcript still matches, by LCP).
        """
        if session is None:
            self.engine.discard_turn(request_id)
            return
        last_used = session.last_used
        session.touch()
        if messages is not None:
            kept = len(session.transcript)

            def undo() -> None:
                del session.transcript[kept:]
                session.last_used = last_used

            session.transcript.extend(messages)
            session.spilled_kv = None
            self._changed(session, lambda changed: turn_record(changed, messages), undo)
            self.engine.commit_turn(request_id, session.id)
        else:
            self.engine.discard_turn(request_id)

        def idle() -> None:
            session.busy = False

        if self.journal is None:
            idle()
        else:
            self.journal.when_settled(session.id, idle)

    def forget_unused(self, session: Session) -> None:
        """Remove a session made for a turn that was dropped: it never held KV nor was saved; never awaits.

        Its journal (the record of its creation) goes too; one a crash leaves behind resumes an empty session.
        """
        if self.sessions.get(session.id) is not session:
            return
        del self.sessions[session.id]
        self._changed_at.pop(session.id, None)
        self._untally(session.id)  # in the background
        if self.journal is not None and self.journal.appending:
            self.journal.discard(session.id)

    def annotate(self, session: Session, name: str, key: str, value: dict[str, Any] | None) -> None:
        """Set one entry of one of session's annotations (value None: remove it), a change journalled as a turn is.

        A session no longer the manager's (deleted meanwhile) only changes in memory; never awaits.
        """
        entries = session.annotations.setdefault(name, {})
        previous = entries.get(key)
        if value is None:
            if entries.pop(key, None) is None:
                return
        else:
            entries[key] = value

        def undo() -> None:
            if previous is None:
                entries.pop(key, None)
            else:
                entries[key] = previous

        if self.sessions.get(session.id) is session:
            self._changed(session, lambda changed: annotation_record(changed, name, key, value), undo)

    def settled(self, session: Session, what: str | None = None) -> Awaitable[None]:
        """Wait until the session's changes made so far are durable (at once unless turns are journalled).

        If the last of them could not be written, it and every change made after the last durable one were taken back
        (the session is as it was before them): StorageError, saying that `what` (default: the session's changes)
        could not be saved. The changes waited on are those made before the call, not when it is awaited.
        """
        entries = self._unconfirmed.get(session.id)
        return self._confirmed(session, entries[-1].outcome if entries else None, what)

    async def _confirmed(self, session: Session, outcome: asyncio.Future[Outcome] | None, what: str | None) -> None:
        error = await self._written(session, outcome)
        if error is not None:
            raise await self._refusal(what or f"the changes of session {session.id!r}", error)

    async def _written(self, session: Session, outcome: asyncio.Future[Outcome] | None) -> Outcome:
        """The outcome of a write of session's changes, once they are settled (kept, or taken back)."""
        if outcome is None:
            return None
        error = await asyncio.shield(outcome)
        self._confirm(session.id)
        return error

    async def stored(self, what: str, call: Callable[..., T], *args: Any) -> T:
        """call(*args) in a worker thread; an OSError that is a fault of the state store is StorageError saying that
        `what` could not be saved."""
        try:
            return await asyncio.to_thread(call, *args)
        except OSError as exc:
            space = await asyncio.to_thread(self.store.space)
            if cause_of(exc, space) is StorageCondition.OK:
                raise
            raise self.health.refusal(what, exc, space) from exc

    async def _refusal(self, what: str, error: OSError) -> StorageError:
        return self.health.refusal(what, error, await asyncio.to_thread(self.store.space))

    # --- snapshots ----------------------------------------------------------------------------------

    async def snapshot(self, session_id: str, metadata: dict[str, Any]) -> dict[str, Any]:
        """Write a snapshot of the session as it is now, owned by the caller; returns the snapshot's manifest."""
        session = self._idle(session_id)
        session.busy = True
        try:
            transcript = [dict(message) for message in session.transcript]
            data = await self._current_kv(session)
        finally:
            session.busy = False
        content = SnapshotContent(transcript, data)
        owner, quota = current_principal().owner, self.limits.snapshot_quota
        async with self._quota_locks.hold(owner):
            room = None if quota is None else quota - await asyncio.to_thread(self.snapshots.usage, owner)
            if room is not None and self.journal is not None:  # the key's session journals count as well
                room -= await self._journal_bytes(owner)
            fields, what = session.manifest_fields(), f"the snapshot of session {session_id!r}"
            return await self.stored(what, self.snapshots.create, content, fields, metadata, owner, room)

    async def load_snapshot(self, snapshot_id: str, session_id: str | None, overwrite: bool) -> Session:
        """A session made from a snapshot, its KV placed in the pool (or held spilled if the pool is full)."""
        manifest, content = await asyncio.to_thread(self.snapshots.read, snapshot_id, current_principal())
        await self._pin_host_memory(content.kv)
        target = check_id(session_id, "session_id") if session_id is not None else new_session_id()
        existing = self.sessions.get(target)
        if existing is not None:
            if not current_principal().may_access(existing.owner):
                raise AlreadyExistsError(f"session {target!r} already exists", param="session_id")
            if not overwrite:
                raise AlreadyExistsError(
                    f"session {target!r} already exists; pass overwrite=true to replace it", param="session_id"
                )
        settings = SessionSettings.from_dict(manifest.get("session", {}))
        session = await self.create(target, settings, content.transcript, replacing=existing)
        if existing is not None:  # its KV and spills go; its saved bundle is superseded by the new session's record
            self._unwritten_spills.discard(target)
            self.engine.release_session_kv(target)
        await self._place(session, content.kv)
        return session

    async def _journal_bytes(self, owner: str) -> int:
        """Bytes of the journals of owner's sessions: those held here, and with a tally those held elsewhere."""
        journal = self.journal
        if journal is None:
            return 0
        held = sum(journal.sizes.get(session.id, 0) for session in self.sessions.values() if session.owner == owner)
        if self.tally is None:
            return held
        elsewhere = [session_id for session_id in await self.tally.owned(owner) if session_id not in self.sessions]
        return held + await asyncio.to_thread(journal.stored_bytes, elsewhere)

    # --- KV placement -------------------------------------------------------------------------------

    async def _place(self, session: Session, data: SessionKVData) -> None:
        """Put KV into the pool for session; if it cannot fit now, keep it spilled."""
        try:
            await self.engine.load_session_kv(session.id, data)
        except SessionKVError as exc:
            log.info("session %s stays spilled: %s", session.id, exc)
            self._hold_spilled(session, data)

    async def _current_kv(self, session: Session) -> SessionKVData:
        """The session's KV wherever it is (an empty one for a session with no turns yet)."""
        data = await self.engine.export_session_kv(session.id)
        if data is None:
            data = await self._kv_outside_pool(session)
        return data if data is not None else self.engine.empty_session_kv()

    async def _kv_outside_pool(self, session: Session) -> SessionKVData | None:
        """Spilled KV, from memory if it is not written yet, else from the session's saved bundle."""
        if session.spilled_kv is not None:
            return session.spilled_kv
        if not session.on_disk:
            return None
        async with self._disk_locks.hold(session.id):
            try:
                _, content = await asyncio.to_thread(
                    read_snapshot, self.saved, Area.SESSIONS, session.id, self.fingerprint
                )
            except (OSError, SessionError) as exc:
                log.warning("spilled KV of session %s is unusable (%s); its next turn recomputes it", session.id, exc)
                return None
        return content.kv

    async def _pin_host_memory(self, data: SessionKVData) -> None:
        """Pin KV bound for a GPU pool in a worker thread, so that loading it copies asynchronously."""
        if self.engine.info.device == "cuda":
            await asyncio.to_thread(data.pin_host_memory)

    def _spilled(self, session_id: str, data: SessionKVData) -> None:
        """The engine spilled a session's KV under memory pressure: keep it and write it to the store."""
        session = self.sessions.get(session_id)
        if session is not None:
            log.info("spilled session %s (%d tokens)", session_id, len(data.tokens))
            self._hold_spilled(session, data)

    def _hold_spilled(self, session: Session, data: SessionKVData) -> None:
        session.spilled_kv = data
        session.stored_tokens = len(data.tokens)
        task = asyncio.get_running_loop().create_task(self._write_spilled(session))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_spilled(self, session: Session) -> None:
        """Write a session's spilled KV to its saved bundle, then let go of the copy in memory; if it cannot be
        written, the copy stays (the session loses nothing) and the write is tried again once the store takes writes.
        """
        try:
            data = session.spilled_kv
            written = data is not None and await self._write_session(session, data)
            if written and session.spilled_kv is data:
                session.spilled_kv = None
            self._unwritten_spills.discard(session.id)
        except (OSError, SessionError) as exc:
            if isinstance(exc, OSError):
                self.health.failed(exc, await asyncio.to_thread(self.store.space))
            if self.sessions.get(session.id) is session:
                self._unwritten_spills.add(session.id)
            log.error("could not write spilled session %s, keeping its KV in memory until it can be: %s",
                      session.id, exc)  # fmt: skip

    async def _save(self, session: Session) -> bool:
        """Write a session for the next run if its saved bundle is not current; True if written."""
        data = await self.engine.export_session_kv(session.id)
        if data is None and (session.spilled_kv is not None or (session.on_disk and session.disk_stale)):
            data = await self._kv_outside_pool(session)
        if data is None and session.on_disk and not session.disk_stale:
            return False
        return await self._write_session(session, data if data is not None else self.engine.empty_session_kv())

    def _delete_saved(self, session_id: str) -> None:
        """Remove a session's saved bundle, if it has one; blocks."""
        with contextlib.suppress(OSError):
            self.saved.delete_bundle(Area.SESSIONS, session_id)

    async def _write_session(self, session: Session, data: SessionKVData) -> bool:
        """Write session (transcript, settings, KV) as its saved bundle; False if it was deleted meanwhile."""
        async with self._disk_locks.hold(session.id):
            if self.sessions.get(session.id) is not session:
                return False
            transcript = [dict(message) for message in session.transcript]
            lsn = session.lsn
            manifest = {
                "id": session.id,
                "created": session.created,
                "lsn": lsn,
                "model": {"name": self.model_name, "fingerprint": self.fingerprint.parts},
                **copy.deepcopy(session.manifest_fields()),  # annotations may change while a worker writes it
            }
            content = SnapshotContent(transcript, data)
            await asyncio.to_thread(write_snapshot, self.saved, Area.SESSIONS, session.id, manifest, content)
            session.on_disk = True
            session.disk_stale = session.lsn != lsn
            if not session.disk_stale and self.journal is not None and self.sessions.get(session.id) is session:
                self.journal.compact(session.id)
            return True

    def _changed(
        self, session: Session, record: Callable[[Session], dict[str, Any]] | None, undo: Callable[[], None]
    ) -> None:
        """A change of session, made in memory: a new lsn, its saved bundle stale, and, when turns are durable, its
        journal record (None: the whole session's), which undo takes back if it cannot be written."""
        session.lsn = self._next_lsn()
        session.disk_stale = True
        self._changed_at[session.id] = time.monotonic()
        journal = self.journal
        if journal is None or not journal.appending:
            return
        whole = partial(session_record, session)
        self._track(session, journal.record(session.id, None if record is None else record(session), whole), undo)

    def _track(self, session: Session, outcome: asyncio.Future[Outcome], undo: Callable[[], None]) -> None:
        """Keep a change's undo until its write's outcome is known (then `_confirm`)."""
        entries = self._unconfirmed.setdefault(session.id, [])
        if not entries or entries[-1].outcome is not outcome:
            outcome.add_done_callback(lambda _: self._confirm(session.id))
        entries.append(_Unconfirmed(outcome, undo, session))

    def _confirm(self, session_id: str) -> None:
        """Settle the session's changes whose writes are done, in order: a durable one is kept; at the first that
        failed, it and every later change (whose writes fail with it) are taken back, latest first, and the journal
        reopened (its next write states the session whole). Runs on the event loop; idempotent."""
        entries = self._unconfirmed.get(session_id, [])
        while entries and entries[0].outcome.done():
            error = entries[0].outcome.result()
            if error is None:
                entries.pop(0)
                continue
            session = entries[0].session
            self.health.failed(error)
            for entry in reversed(entries):
                entry.undo()
            entries.clear()
            session.disk_stale = True
            if self.journal is not None:
                self.journal.reopen(session_id)
            for listener in self.reverted:
                listener(session)
        if not entries:
            self._unconfirmed.pop(session_id, None)

    # --- the state store's condition ------------------------------------------------------------------

    async def _watch_storage(self, period: float) -> None:
        """Look at the store every period: report its condition, remake it if it vanished, pay what it is owed."""
        while True:
            await asyncio.sleep(period)
            try:
                await self.check_storage()
            except Exception:  # keep watching: a bug here must not stop the healing
                log.exception("checking the state store failed")

    async def check_storage(self) -> None:
        """Probe the store; remake it if it vanished; once it takes writes, rewrite the journals failed writes broke
        and write the spills that could not be written. /health then reports what is still owed, if anything."""
        space = await asyncio.to_thread(self.store.space)
        if space.condition is StorageCondition.MISSING:
            await self._remake_store()
            space = await asyncio.to_thread(self.store.space)
        if self.owed() and self._worth_trying(space):
            await self._pay_owed()
            if self.owed():  # still failing: wait for more room before the next try
                self._failed_with_free = space.free_bytes or 0
        self.health.observe(space, len(self.owed()))

    def _worth_trying(self, space: StoreSpace) -> bool:
        """Whether to try the owed writes now: the store looks fine, or it is full but has more room than when they
        last failed (so that a store that stays full is not written to, and logged about, every second)."""
        if space.condition is StorageCondition.OK:
            return True
        return space.condition is StorageCondition.FULL and (space.free_bytes or 0) > self._failed_with_free

    def storage_report(self) -> dict[str, object]:
        """The state store's condition for /health, as last seen (no I/O)."""
        return self.health.report(len(self.owed()))

    def owed(self) -> set[str]:
        """The sessions held here whose journal must be rewritten, or whose spilled KV could not be written."""
        broken = self.journal.broken() if self.journal is not None and self.journal.appending else set()
        return {sid for sid in broken | self._unwritten_spills if sid in self.sessions}

    async def _pay_owed(self) -> None:
        """Rewrite each broken journal of an idle session as the whole session, and write the unwritten spills."""
        journal = self.journal
        for session_id in self.owed():
            session = self.sessions.get(session_id)
            if session is None or session.busy:
                continue
            if session_id in self._unwritten_spills:
                await self._write_spilled(session)
            if journal is not None and journal.needs_rewrite(session_id) and session_id not in self._unconfirmed:
                self._changed(session, None, _nothing)  # a new lsn: the record supersedes any saved bundle
                entries = self._unconfirmed.get(session_id)
                await self._written(session, entries[-1].outcome if entries else None)
        if not self.owed():
            log.info("%s takes writes again: every session's journal and spill is written", self.health.space.location)

    async def _remake_store(self) -> None:
        """The state store vanished (its directory deleted): make it again and journal every session anew. What it
        held is gone: saved KV (each session's next turn recomputes it) and snapshots."""
        try:
            for area in (Area.SESSIONS, Area.JOURNAL, Area.SNAPSHOTS):
                await asyncio.to_thread(self.store.prepare, area, False)
        except OSError as exc:
            if not self._remake_failed:
                log.error("%s vanished and cannot be made again (%s); tried again every %.0f s",
                          self.health.space.location, exc, self.storage_check_s)  # fmt: skip
            self._remake_failed = True
            return
        self._remake_failed = False
        log.error("%s vanished: made it again; every session is journalled anew, their saved KV and every snapshot "
                  "are lost", self.health.space.location)  # fmt: skip
        for session in self.sessions.values():
            session.on_disk = False
            session.disk_stale = True
            if self.journal is not None and self.journal.appending:
                self.journal.mark_broken(session.id)
        if self.journal is not None:
            self.journal.sizes.clear()

    def _next_lsn(self) -> int:
        self._last_lsn += 1
        return self._last_lsn

    def _idle(self, session_id: str, kind: SessionKind = SessionKind.SESSION) -> Session:
        session = self.get(session_id, kind)
        if session.busy:
            raise SessionBusyError(f"session {session_id!r} is busy with another request; retry when it is done")
        return session

    def _untally(self, session_id: str) -> Awaitable[object] | None:
        return self.tally.release(session_id) if self.tally is not None else None


def _nothing() -> None:
    """The undo of a write that changes nothing in memory."""


def _limit_error(limit: int) -> SessionLimitError:
    return SessionLimitError(f"this key already has {limit} sessions, the most it may have; delete some first")
