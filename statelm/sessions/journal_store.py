"""The journals of all sessions in a state store: each session's writes in order, in worker threads, and the outcome
of each told to whoever waits on it.

A change is encoded on the event loop, so a record states the session as it was then, and written by a few worker
threads: one session's writes run one after another in the order they were asked for, different sessions' in
parallel. The session manager journals its changes with `record`: the changes of one session made in one step of the
event loop go into one write (their record, or a `batch` record holding them, torn and replayed whole), so that what
one request changes is durable whole or not at all; a journal that must be written whole (a new session, or one
whose last write failed) is written as the session's `session` record instead.

Every write of a change has an outcome, None or the OSError that failed it, which the session manager waits on
before it answers. A failed write (a full disk) breaks the session's journal: the writes of that session already
asked for fail with it without running (their records build on the change that failed), until the manager has taken
the failed changes back and `reopen`s the journal; its next write then states the whole session again, replacing
whatever the failed write left in the file. Removals (a compaction, a deleted session's journal) are not changes: one
that fails is logged and leaves a journal that recovery still reads right.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from statelm.sessions.errors import SessionError, check_id
from statelm.sessions.journal import encode_record
from statelm.sessions.journal_records import batch_record, delete_record
from statelm.sessions.state_store import StateStore

log = logging.getLogger(__name__)
WORKERS = 4  # fsyncs of different sessions in flight at once (a journaling file system commits them together)
SLOW_WRITE_S = 1.0  # a journal write slower than this is counted, and logged (at most once a minute)
Outcome = OSError | None  # how a write ended: None once durable, else what failed it


@dataclass
class JournalCounters:
    """What the journals did since start: records written, their bytes, sessions recovered, failed writes, and the
    time writes took."""

    appends: int = 0
    bytes: int = 0
    recoveries: int = 0
    failures: int = 0
    write_seconds: float = 0.0
    slow_writes: int = 0


@dataclass
class _Batch:
    """The records of one session's changes asked for in this step of the event loop, not yet written."""

    epoch: int
    whole: Callable[[], dict[str, Any]]  # the session as one record
    outcome: asyncio.Future[Outcome]
    records: list[dict[str, Any]] = field(default_factory=list)
    rewrite: bool = False  # the journal is written whole


class SessionJournal:
    """The journals (logs) of a state store, written off the event loop, one session's writes in order.

    With `appending` false (spill durability) no change is journalled; journals left by an earlier run are
    still compacted away and deleted with their sessions.
    """

    def __init__(
        self, store: StateStore, appending: bool, counters: JournalCounters | None = None, workers: int = WORKERS
    ) -> None:
        self.store = store
        self.appending = appending
        self.counters = counters or JournalCounters()
        self.sizes: dict[str, int] = {}  # bytes of each session's journal in the store
        self._broken: set[str] = set()  # journals whose next write states the whole session
        self._epochs: dict[str, int] = {}  # sessions whose journal was reopened: how many times
        self._failed: dict[str, tuple[int, OSError]] = {}  # session → the epoch whose writes fail, and why
        self._batches: dict[str, _Batch] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="statelm-journal")
        self._tails: dict[str, asyncio.Task[Outcome]] = {}
        self._slow_logged = -math.inf

    def stored_bytes(self, session_ids: list[str]) -> int:
        """Bytes of the journals of sessions this journal may not be writing (another server's); blocks."""
        total = 0
        for session_id in session_ids:
            try:
                total += self.store.log_size(check_id(session_id, "session_id"))
            except (OSError, SessionError):
                continue  # none (compacted), or not an id
        return total

    def needs_rewrite(self, session_id: str) -> bool:
        """Whether a write to the session's journal failed since the last whole-session record."""
        return session_id in self._broken

    def broken(self) -> set[str]:
        """The sessions whose journal a failed write broke (each waits for a whole-session record)."""
        return set(self._broken)

    def record(
        self, session_id: str, record: dict[str, Any] | None, whole: Callable[[], dict[str, Any]]
    ) -> asyncio.Future[Outcome]:
        """Journal a change of the session with its other changes of this step: its record (None: the journal is
        written whole, from whole(), the session as one record, called when the write is asked for); the outcome of
        the write that holds it."""
        batch = self._batches.get(session_id)
        if batch is None:
            loop = asyncio.get_running_loop()
            batch = _Batch(self._epochs.get(session_id, 0), whole, loop.create_future())
            self._batches[session_id] = batch
            loop.call_soon(self._flush, session_id)
        if record is None:
            batch.rewrite = True
        else:
            batch.records.append(record)
        return batch.outcome

    def append(self, session_id: str, record: dict[str, Any]) -> asyncio.Future[Outcome]:
        """Append a record to the session's journal, durably; its outcome."""
        data = encode_record(record)
        return self._submit(session_id, "append", partial(self._append, session_id, data), self._epoch(session_id))

    def rewrite(self, session_id: str, record: dict[str, Any]) -> asyncio.Future[Outcome]:
        """Make a whole-session record the journal's only content (atomically); its outcome."""
        data = encode_record(record)
        return self._submit(session_id, "rewrite", partial(self._rewrite, session_id, data), self._epoch(session_id))

    def reopen(self, session_id: str) -> None:
        """Let the session's journal be written again after a failed write, whose changes (and those that followed
        it) the caller has taken back: the writes asked for before still fail, the next states the whole session."""
        self._flush(session_id)
        self._epochs[session_id] = self._epoch(session_id) + 1

    def compact(self, session_id: str) -> None:
        """Remove the session's journal: its saved bundle now holds everything the journal said."""
        self._submit(session_id, "compaction", partial(self._remove, session_id, None))

    def delete(self, session_id: str, lsn: int) -> asyncio.Future[Outcome]:
        """Record durably that the session is deleted, before its saved bundle goes (the journal then only says so);
        the write's outcome."""
        data = encode_record(delete_record(lsn))
        return self._submit(session_id, "delete", partial(self._rewrite, session_id, data), self._epoch(session_id))

    def mark_broken(self, session_id: str) -> None:
        """Have the session's journal written whole at its next write (what it held is lost: its directory vanished)."""
        with self._lock:
            self._broken.add(session_id)

    def forget(self, session_id: str, lsn: int) -> None:
        """Remove the journal of a deleted session once its saved bundle is gone, unless a new session took its id."""
        self._submit(session_id, "removal", partial(self._remove, session_id, encode_record(delete_record(lsn))))

    def discard(self, session_id: str) -> None:
        """Remove the journal of a session forgotten before it was ever saved (nothing else of it is in the store)."""
        self._submit(session_id, "removal", partial(self._remove, session_id, None))

    async def settled(self, session_id: str) -> Outcome:
        """Wait until every write asked for the session so far is done; the outcome of the last."""
        self._flush(session_id)
        tail = self._tails.get(session_id)
        return None if tail is None else await asyncio.shield(tail)

    def when_settled(self, session_id: str, callback: Callable[[], None]) -> None:
        """Call callback (on the event loop) once every write asked for the session so far is done (changes of this
        step still to come join them)."""
        batch = self._batches.get(session_id)
        tail = batch.outcome if batch is not None else self._tails.get(session_id)
        if tail is None:
            callback()
        else:
            tail.add_done_callback(lambda _: callback())

    async def close(self) -> None:
        """Wait for every write, then stop the worker threads."""
        for session_id in list(self._batches):
            self._flush(session_id)
        while self._tails:
            await asyncio.wait(list(self._tails.values()))
        self._executor.shutdown()

    def _epoch(self, session_id: str) -> int:
        return self._epochs.get(session_id, 0)

    def _flush(self, session_id: str) -> None:
        """Ask for the write of the session's changes of this step, if any."""
        batch = self._batches.pop(session_id, None)
        if batch is None:
            return
        if batch.rewrite or session_id in self._broken:
            what, data, write = "rewrite", encode_record(batch.whole()), self._rewrite
        else:
            record = batch.records[0] if len(batch.records) == 1 else batch_record(batch.records)
            what, data, write = "append", encode_record(record), self._append
        task = self._submit(session_id, what, partial(write, session_id, data), batch.epoch)
        task.add_done_callback(lambda done: batch.outcome.set_result(done.result()))

    def _submit(
        self, session_id: str, what: str, write: Callable[[], None], epoch: int | None = None
    ) -> asyncio.Task[Outcome]:
        """Queue a write behind the session's earlier ones; epoch None: a removal, which no failure holds back."""
        check_id(session_id, "session_id")
        self._flush(session_id)  # the changes asked for before go first
        task = asyncio.get_running_loop().create_task(
            self._run(self._tails.get(session_id), partial(self._guarded, session_id, what, write, epoch))
        )
        self._tails[session_id] = task
        task.add_done_callback(partial(self._retire, session_id))
        return task

    async def _run(self, previous: asyncio.Task[Outcome] | None, write: Callable[[], Outcome]) -> Outcome:
        if previous is not None:
            await asyncio.wait([previous])
        return await asyncio.get_running_loop().run_in_executor(self._executor, write)

    def _retire(self, session_id: str, task: asyncio.Task[Outcome]) -> None:
        if self._tails.get(session_id) is task:
            del self._tails[session_id]

    def _guarded(self, session_id: str, what: str, write: Callable[[], None], epoch: int | None) -> Outcome:
        """Run a write in a worker thread, unless a write of the same epoch failed before it; its outcome."""
        with self._lock:
            failed = self._failed.get(session_id)
        if epoch is not None and failed is not None and failed[0] == epoch:
            self._count(failures=1)
            return failed[1]
        started = time.perf_counter()
        try:
            write()
        except OSError as exc:
            self._count(failures=1)
            if epoch is None:
                log.warning("journal of session %s: %s failed (%s)", session_id, what, exc)
                return None
            with self._lock:
                self._broken.add(session_id)
                self._failed[session_id] = (epoch, exc)
            log.error("journal of session %s: %s failed (%s); the change is refused, and the journal is rewritten "
                      "whole once the state store takes writes again", session_id, what, exc)  # fmt: skip
            return exc
        finally:
            self._timed(session_id, what, time.perf_counter() - started)
        return None

    def _timed(self, session_id: str, what: str, seconds: float) -> None:
        slow = seconds >= SLOW_WRITE_S
        with self._lock:
            self.counters.write_seconds += seconds
            self.counters.slow_writes += slow
            now = time.monotonic()
            report = slow and now - self._slow_logged >= 60
            if report:
                self._slow_logged = now
        if report:
            log.warning("journal of session %s: a %s took %.1f s (a slow disk): the changes waiting on it were "
                        "answered that much later", session_id, what, seconds)  # fmt: skip

    def _append(self, session_id: str, data: bytes) -> None:
        self.sizes[session_id] = self.store.append_log(session_id, data)
        self._count(appends=1, written=len(data))

    def _rewrite(self, session_id: str, data: bytes) -> None:
        self.sizes[session_id] = self.store.replace_log(session_id, data)
        with self._lock:
            self._broken.discard(session_id)
            self._failed.pop(session_id, None)
        self._count(appends=1, written=len(data))

    def _remove(self, session_id: str, only_if: bytes | None) -> None:
        """Remove the journal; with only_if, only while that is all it holds."""
        if only_if is not None:
            try:
                if self.store.read_log(session_id) != only_if:
                    return
            except FileNotFoundError:
                return
        self.store.remove_log(session_id)
        self.sizes.pop(session_id, None)
        with self._lock:
            self._broken.discard(session_id)

    def _count(self, appends: int = 0, written: int = 0, failures: int = 0) -> None:
        with self._lock:
            self.counters.appends += appends
            self.counters.bytes += written
            self.counters.failures += failures
