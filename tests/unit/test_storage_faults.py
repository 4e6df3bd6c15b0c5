"""Faults of the state store below the server: failed journal writes and what follows them, changes written whole or
not at all, the directory store's cleanup after a failed write and its condition, refusal messages, processes killed
mid-write, and retention across a clock set back."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from statelm.api.responses.chains import ANNOTATION, ResponseChains, ResponseRetention, records
from statelm.config import format_size
from statelm.sessions.directory_store import DirectoryStore
from statelm.sessions.journal import decode_journal
from statelm.sessions.journal_records import annotation_record, session_record, turn_record
from statelm.sessions.journal_store import SessionJournal
from statelm.sessions.ownership import LOCAL
from statelm.sessions.recovery import recover_sessions
from statelm.sessions.session import Session, SessionKind, SessionSettings
from statelm.sessions.state_store import Area, StateStore
from statelm.sessions.storage import RETRY_AFTER_S, StorageCondition, StorageHealth, StoreSpace
from tests.unit.faulty_state_store import LOG_WRITES, Fault, FaultyStore
from tests.unit.test_session_journal import FINGERPRINT, REPLY, USER, new_session, read_journal


def test_a_failed_write_fails_the_writes_after_it_until_the_journal_is_reopened(state_store: StateStore) -> None:
    store = FaultyStore(state_store)
    store.prepare(Area.JOURNAL, exclusive=True)

    async def scenario() -> None:
        journal = SessionJournal(store, appending=True)
        session = new_session("a")
        assert await journal.rewrite("a", session_record(session)) is None
        store.inject(Fault(LOG_WRITES, errno.ENOSPC, times=1))
        session.lsn = 2
        failed = journal.append("a", turn_record(session, [USER, REPLY]))
        session.lsn = 3
        after = journal.append("a", turn_record(session, [USER, REPLY]))  # builds on the change that fails
        error = await failed
        assert isinstance(error, OSError) and error.errno == errno.ENOSPC and await after is error
        assert journal.needs_rewrite("a") and journal.broken() == {"a"} and journal.counters.failures == 2
        assert await journal.append("a", turn_record(session, [USER])) is error  # not reopened: still refused
        journal.reopen("a")
        session.transcript.append(USER)
        written = journal.record("a", turn_record(session, [USER]), whole=lambda: session_record(session))
        assert await written is None and not journal.needs_rewrite("a")
        assert read_journal(store, "a") == [session_record(session)]  # written whole, what the failures left gone
        await journal.close()

    asyncio.run(scenario())


def test_the_changes_of_one_step_are_written_and_torn_as_one_record(
    state_store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    store = FaultyStore(state_store)
    store.prepare(Area.JOURNAL, exclusive=True)
    session = new_session("b")

    async def change(lsn: int) -> None:
        """A turn and an annotation made in one step: both in one write."""
        whole = lambda: session_record(session)  # noqa: E731
        session.lsn = lsn
        session.transcript += [USER, REPLY]
        first = journal.record("b", turn_record(session, [USER, REPLY]), whole)
        session.lsn = lsn + 1
        session.annotations.setdefault("n", {})["k"] = {"v": lsn}
        second = journal.record("b", annotation_record(session, "n", "k", {"v": lsn}), whole)
        assert first is second
        await first

    async def scenario() -> None:
        assert await journal.record("b", None, lambda: session_record(session)) is None
        await change(2)
        store.inject(Fault(frozenset({"append_log"}), errno.ENOSPC, times=1, torn=True))
        await change(4)  # half of its record reaches the log
        await journal.close()

    journal = SessionJournal(store, appending=True)
    asyncio.run(scenario())
    assert [record["type"] for record in decode_journal(store.read_log("b")).records] == ["session", "batch"]
    with caplog.at_level(logging.WARNING):
        (recovered,) = recover_sessions(store, FINGERPRINT).sessions
    assert "torn last record" in caplog.text  # the failed batch, dropped whole: neither of its changes is there
    assert recovered.transcript == session.transcript[:3] and recovered.annotations == {"n": {"k": {"v": 2}}}
    assert recovered.lsn == 3


def test_a_failed_write_in_the_directory_leaves_no_temporary_nor_torn_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DirectoryStore(tmp_path / "state")
    for area in Area:
        store.prepare(area, exclusive=True)
    store.write_bundle(Area.SNAPSHOTS, "snap", {"a": b"old"})
    store.append_log("log", b"first record")

    def full(_: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    for write in (
        lambda: store.append_log("log", b"second record"),
        lambda: store.replace_log("log", b"replacement"),
        lambda: store.replace_file(Area.SNAPSHOTS, "snap", "a", b"new"),
        lambda: store.write_bundle(Area.SNAPSHOTS, "snap", {"a": b"new"}),
        lambda: store.write_bundle(Area.SNAPSHOTS, "other", {"a": b"new"}),
    ):
        with pytest.raises(OSError, match="No space left"):
            write()
    monkeypatch.undo()
    assert store.read_log("log") == b"first record" and store.read_file(Area.SNAPSHOTS, "snap", "a") == b"old"
    assert store.bundle_names(Area.SNAPSHOTS) == ["snap"]
    leftovers = [entry.name for area in Area for entry in (tmp_path / "state" / area).iterdir()]
    assert sorted(leftovers) == ["log.journal", "snap"]
    assert [entry.name for entry in (tmp_path / "state" / "snapshots" / "snap").iterdir()] == ["a"]


def test_the_directory_store_reports_where_it_is_and_its_room(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path / "state")
    store.prepare(Area.JOURNAL, exclusive=True)
    space = store.space()
    stats = os.statvfs(tmp_path)
    assert space.location == f"the state directory {tmp_path / 'state'}"
    assert space.total_bytes == stats.f_blocks * stats.f_frsize and space.free_bytes is not None
    expected = StorageCondition.OK if space.free_bytes >= 1 << 20 else StorageCondition.FULL
    assert space.condition is expected
    (tmp_path / "state" / "journal").rmdir()
    (tmp_path / "state").rmdir()
    assert store.space() == StoreSpace(space.location, StorageCondition.MISSING)


def test_a_refusal_says_what_could_not_be_saved_where_and_the_room_left() -> None:
    location = "the state directory /srv/state"
    health = StorageHealth(StoreSpace(location, StorageCondition.OK, 1 << 30, 2 << 30))
    full = StoreSpace(location, StorageCondition.FULL, 4096, 12 << 20)
    refusal = health.refusal("the new session 's'", OSError(errno.ENOSPC, "No space left on device"), full)
    assert refusal.code == "insufficient_storage" and refusal.cause is StorageCondition.FULL
    assert refusal.retry_after == RETRY_AFTER_S
    assert refusal.message == (
        "could not save the new session 's': the state directory /srv/state is full (4.0 KiB free of 12.0 MiB); "
        "free some space there, then retry"
    )
    read_only = StoreSpace(location, StorageCondition.READ_ONLY, 1 << 30, 2 << 30)
    refusal = health.refusal("the turn", OSError(errno.EROFS, "Read-only file system"), read_only)
    assert refusal.cause is StorageCondition.READ_ONLY and "is read-only; remount it read-write" in refusal.message
    gone = StoreSpace(location, StorageCondition.MISSING)
    refusal = health.refusal("the turn", FileNotFoundError(errno.ENOENT, "No such file or directory"), gone)
    assert refusal.cause is StorageCondition.MISSING and "no longer exists" in refusal.message
    there = StoreSpace(location, StorageCondition.OK, 1 << 30, 2 << 30)
    failing = health.refusal("the turn", OSError(errno.EIO, "Input/output error"), there)
    assert failing.cause is StorageCondition.FAILING and "failed ([Errno 5] Input/output error)" in failing.message
    assert health.refusals == {
        StorageCondition.FULL: 1,
        StorageCondition.READ_ONLY: 1,
        StorageCondition.MISSING: 1,
        StorageCondition.FAILING: 1,
    }
    assert format_size(4096) == "4.0 KiB"


def test_the_condition_is_the_stores_or_while_writes_are_owed_the_cause_of_the_last_failure() -> None:
    ok = StoreSpace("the state store", StorageCondition.OK, 1 << 30, 2 << 30)
    health = StorageHealth(ok)
    assert health.condition(owed=0) is StorageCondition.OK
    health.failed(OSError(errno.ENOSPC, "No space left on device"))
    assert health.condition(owed=0) is StorageCondition.OK  # nothing owed: the refusal said it all
    assert health.condition(owed=2) is StorageCondition.FULL
    health.observe(ok, owed=1)  # room again, one journal still to rewrite
    assert health.condition(owed=1) is StorageCondition.FULL
    health.observe(ok, owed=0)
    assert health.condition(owed=0) is StorageCondition.OK and health.report(0)["condition"] == "ok"
    health.observe(StoreSpace("the state store", StorageCondition.READ_ONLY, 0, 1), owed=0)
    assert health.report(0) == {
        "condition": "read-only",
        "free_bytes": 0,
        "total_bytes": 1,
        "owed_writes": 0,
    }


WRITER = """
import sys
from pathlib import Path
from statelm.sessions.directory_store import DirectoryStore
from statelm.sessions.journal import encode_record
from statelm.sessions.state_store import Area

store, size = DirectoryStore(Path(sys.argv[1])), int(sys.argv[2])
for area in Area:
    store.prepare(area, exclusive=True)
print("ready", flush=True)
turn = 0
while True:
    turn += 1
    version = str(turn % 10).encode() * size
    store.write_bundle(Area.SNAPSHOTS, "bundle", {"a": version, "b": version})
    store.replace_file(Area.SNAPSHOTS, "bundle", "a", version[::-1])
    store.replace_log("replaced", version)
    store.append_log("appended", encode_record({"turn": turn, "pad": "x" * size}))
"""


def test_a_process_killed_during_each_kind_of_write_leaves_every_bundle_and_log_whole(tmp_path: Path) -> None:
    """SIGKILL at random moments of a writer doing every kind of write; after each, a start's `prepare` finds the
    bundle and the replaced log whole (some version), the appended log valid but for a torn tail (which a start cuts
    off, as session recovery does, before the next writer appends), no temporary."""
    rng = random.Random(32)
    root, size = tmp_path / "state", 64 * 1024
    for _ in range(12):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(size)], stdout=subprocess.PIPE)
        assert writer.stdout is not None and writer.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.02, 0.3))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        store = DirectoryStore(root)
        for area in Area:
            store.prepare(area, exclusive=True)
        assert not [entry for area in Area for entry in (root / area).iterdir() if entry.name.startswith(".")]
        if store.bundle_exists(Area.SNAPSHOTS, "bundle"):
            files = {file: store.read_file(Area.SNAPSHOTS, "bundle", file) for file in ("a", "b")}
            assert all(len(data) == size and len(set(data)) == 1 for data in files.values())
        if store.log_exists("replaced"):
            data = store.read_log("replaced")
            assert len(data) == size and len(set(data)) == 1
        if store.log_exists("appended"):
            contents = decode_journal(store.read_log("appended"))  # a damaged record before a valid one raises
            assert all(record["pad"] == "x" * size for record in contents.records)
            store.truncate_log("appended", contents.valid_bytes)  # a start cuts a torn tail before appending again


class _Manager:
    """What ResponseChains asks of the session manager: annotations kept in the session, no tally."""

    tally = None

    def __init__(self) -> None:
        self.reverted: list[Any] = []

    def annotate(self, session: Session, name: str, key: str, value: dict[str, Any] | None) -> None:
        entries = session.annotations.setdefault(name, {})
        if value is None:
            entries.pop(key, None)
        else:
            entries[key] = value


def stored_at(created_at: float) -> dict[str, Any]:
    return {"count": 2, "created_at": created_at, "response": {}, "input_items": []}


def test_a_clock_set_back_neither_drops_stored_responses_nor_keeps_them_until_it_catches_up() -> None:
    chains = ResponseChains(ResponseRetention(max_per_key=None, max_age=100.0), _Manager())  # type: ignore[arg-type]
    chain = Session("chain", SessionSettings(), kind=SessionKind.RESPONSES)
    chains.put(chain, "before", stored_at(1000.0))
    assert chains.expired(1050.0) == [] and chains.find("before", LOCAL, 1050.0) is not None
    set_back = 500.0  # the clock jumps back by 550 s
    assert chains.expired(set_back) == [] and chains.find("before", LOCAL, set_back) is not None  # not dropped
    chains.put(chain, "after", stored_at(set_back + 10))
    assert chains.expired(set_back + 99) == []
    assert chains.find("before", LOCAL, set_back + 101) is None  # kept the retention's age from the jump, no more
    assert chains.expired(set_back + 101) == ["before"] and chains.expired(set_back + 111) == ["before", "after"]


def test_a_chains_index_follows_its_records_when_their_changes_are_taken_back() -> None:
    manager = _Manager()
    chains = ResponseChains(ResponseRetention(max_per_key=None, max_age=None), manager)  # type: ignore[arg-type]
    assert manager.reverted == [chains.resync]
    chain = Session("chain", SessionSettings(), kind=SessionKind.RESPONSES)
    chains.put(chain, "kept", stored_at(1.0))
    chains.put(chain, "refused", stored_at(2.0))
    chains.drop("kept")
    del records(chain)["refused"]  # what the session manager's undo does to a change that could not be saved…
    chain.annotations[ANNOTATION]["kept"] = stored_at(1.0)
    chains.resync(chain)  # …and then it tells the index
    assert chains.find("refused", LOCAL, 3.0) is None and chains.find("kept", LOCAL, 3.0) is not None
