"""The journals of all sessions in a state store: each session's writes in order, in worker threads.

A change is encoded on the event loop when it happens, so a record states the session as it was then, and
written by a few worker threads: one session's writes run one after another in the order they were asked
for, different sessions' in parallel. `settled` waits until everything asked for a session is durable.

A write that fails (a full disk) is logged and counted, and the session's journal is marked broken: its
later changes are not appended until a whole-session record replaces the journal, which the manager
writes at the session's next change (`needs_rewrite`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from statelm.sessions.errors import SessionError, check_id
from statelm.sessions.journal import encode_record
from statelm.sessions.journal_records import delete_record
from statelm.sessions.state_store import StateStore

log = logging.getLogger(__name__)
WORKERS = 4  # fsyncs of different sessions in flight at once (a journaling file system commits them together)


@dataclass
class JournalCounters:
    """What the journals did since start: records written, their bytes, sessions recovered, failed writes."""

    appends: int = 0
    bytes: int = 0
    recoveries: int = 0
    failures: int = 0


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
        self._broken: set[str] = set()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="statelm-journal")
        self._tails: dict[str, asyncio.Task[None]] = {}

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

    def append(self, session_id: str, record: dict[str, Any]) -> None:
        """Append a record to the session's journal, durably (a broken journal skips it)."""
        data = encode_record(record)
        self._submit(session_id, "append", partial(self._append, session_id, data))

    def rewrite(self, session_id: str, record: dict[str, Any]) -> None:
        """Make a whole-session record the journal's only content (atomically)."""
        data = encode_record(record)
        self._submit(session_id, "rewrite", partial(self._rewrite, session_id, data))

    def compact(self, session_id: str) -> None:
        """Remove the session's journal: its saved bundle now holds everything the journal said."""
        self._submit(session_id, "compaction", partial(self._remove, session_id, None))

    async def delete(self, session_id: str, lsn: int) -> None:
        """Record durably that the session is deleted, before its saved bundle goes (the journal then only says so)."""
        self._submit(session_id, "delete", partial(self._rewrite, session_id, encode_record(delete_record(lsn))))
        await self.settled(session_id)

    def forget(self, session_id: str, lsn: int) -> None:
        """Remove the journal of a deleted session once its saved bundle is gone, unless a new session took its id."""
        self._submit(session_id, "removal", partial(self._remove, session_id, encode_record(delete_record(lsn))))

    def discard(self, session_id: str) -> None:
        """Remove the journal of a session forgotten before it was ever saved (nothing else of it is in the store)."""
        self._submit(session_id, "removal", partial(self._remove, session_id, None))

    async def settled(self, session_id: str) -> None:
        """Wait until every write asked for the session so far is done (durable, or failed and logged)."""
        tail = self._tails.get(session_id)
        if tail is not None:
            await asyncio.shield(tail)

    def when_settled(self, session_id: str, callback: Callable[[], None]) -> None:
        """Call callback (on the event loop) once every write asked for the session so far is done."""
        tail = self._tails.get(session_id)
        if tail is None:
            callback()
        else:
            tail.add_done_callback(lambda _: callback())

    async def close(self) -> None:
        """Wait for every write, then stop the worker threads."""
        while self._tails:
            await asyncio.wait(list(self._tails.values()))
        self._executor.shutdown()

    def _submit(self, session_id: str, what: str, write: Callable[[], None]) -> None:
        check_id(session_id, "session_id")
        task = asyncio.get_running_loop().create_task(
            self._run(self._tails.get(session_id), partial(self._guarded, session_id, what, write))
        )
        self._tails[session_id] = task
        task.add_done_callback(partial(self._retire, session_id))

    async def _run(self, previous: asyncio.Task[None] | None, write: Callable[[], None]) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        await asyncio.get_running_loop().run_in_executor(self._executor, write)

    def _retire(self, session_id: str, task: asyncio.Task[None]) -> None:
        if self._tails.get(session_id) is task:
            del self._tails[session_id]

    def _guarded(self, session_id: str, what: str, write: Callable[[], None]) -> None:
        """Run a write in a worker thread; a failure breaks the journal until its next rewrite."""
        try:
            write()
        except OSError as exc:
            self._broken.add(session_id)
            self._count(failures=1)
            log.error("journal of session %s: %s failed (%s); its changes are not durable until rewritten",
                      session_id, what, exc)  # fmt: skip

    def _append(self, session_id: str, data: bytes) -> None:
        if session_id in self._broken:
            self._count(failures=1)
            return
        self.sizes[session_id] = self.store.append_log(session_id, data)
        self._count(appends=1, written=len(data))

    def _rewrite(self, session_id: str, data: bytes) -> None:
        self.sizes[session_id] = self.store.replace_log(session_id, data)
        self._broken.discard(session_id)
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
        self._broken.discard(session_id)

    def _count(self, appends: int = 0, written: int = 0, failures: int = 0) -> None:
        with self._lock:
            self.counters.appends += appends
            self.counters.bytes += written
            self.counters.failures += failures
