"""The state store protocol, on a directory and in memory: bundles, logs, private stores; the directory's layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from statelm.cluster.store import StoredSessions
from statelm.engine.session_kv import SessionKVData
from statelm.sessions.directory_store import DirectoryStore
from statelm.sessions.journal import encode_record
from statelm.sessions.snapshot_format import SnapshotContent, encode_snapshot, write_snapshot
from statelm.sessions.state_store import Area, StateStore
from statelm.sessions.temporaries import OLD_PREFIX, TEMP_PREFIX

FILES = {"b.json": b'{"b": 1}', "a.bin": b"\x00\x01\x02"}


def test_a_bundle_is_written_read_sized_listed_and_deleted(state_store: StateStore) -> None:
    assert state_store.bundle_names(Area.SESSIONS) == [] and not state_store.bundle_exists(Area.SESSIONS, "x")
    state_store.write_bundle(Area.SESSIONS, "x", FILES)
    state_store.write_bundle(Area.SESSIONS, "a", {"only": b"1"})
    state_store.write_bundle(Area.SNAPSHOTS, "x", {"other": b"area"})
    assert state_store.bundle_names(Area.SESSIONS) == ["a", "x"] and state_store.bundle_names(Area.SNAPSHOTS) == ["x"]
    assert state_store.bundle_exists(Area.SESSIONS, "x") and not state_store.bundle_exists(Area.SNAPSHOTS, "a")
    assert state_store.read_file(Area.SESSIONS, "x", "a.bin") == FILES["a.bin"]
    assert state_store.bundle_size(Area.SESSIONS, "x") == sum(map(len, FILES.values()))
    state_store.delete_bundle(Area.SESSIONS, "x")
    assert state_store.bundle_names(Area.SESSIONS) == ["a"] and state_store.bundle_names(Area.SNAPSHOTS) == ["x"]
    for missing in (
        lambda: state_store.read_file(Area.SESSIONS, "x", "a.bin"),
        lambda: state_store.read_file(Area.SESSIONS, "a", "a.bin"),
        lambda: state_store.replace_file(Area.SESSIONS, "x", "a.bin", b""),
        lambda: state_store.bundle_size(Area.SESSIONS, "x"),
        lambda: state_store.delete_bundle(Area.SESSIONS, "x"),
    ):
        with pytest.raises(FileNotFoundError):
            missing()


def test_a_bundle_is_replaced_whole_and_a_file_of_it_alone(state_store: StateStore) -> None:
    state_store.write_bundle(Area.SNAPSHOTS, "s", FILES)
    state_store.write_bundle(Area.SNAPSHOTS, "s", {"new": b"content"})  # the old files go with the old bundle
    with pytest.raises(FileNotFoundError):
        state_store.read_file(Area.SNAPSHOTS, "s", "a.bin")
    state_store.replace_file(Area.SNAPSHOTS, "s", "new", b"replaced")
    assert state_store.read_file(Area.SNAPSHOTS, "s", "new") == b"replaced"
    assert state_store.bundle_size(Area.SNAPSHOTS, "s") == len(b"replaced")
    assert state_store.bundle_names(Area.SNAPSHOTS) == ["s"]


def test_a_log_is_appended_replaced_read_truncated_and_removed(state_store: StateStore) -> None:
    state_store.prepare(Area.JOURNAL, exclusive=True)
    assert state_store.log_names() == [] and not state_store.log_exists("s")
    assert [state_store.append_log("s", chunk) for chunk in (b"one", b"two", b"three")] == [3, 6, 11]
    assert state_store.read_log("s") == b"onetwothree" and state_store.log_size("s") == 11
    state_store.truncate_log("s", 5)
    assert state_store.read_log("s") == b"onetw" and state_store.append_log("s", b"!") == 6
    assert state_store.replace_log("a", b"whole") == 5 and state_store.replace_log("s", b"new") == 3
    assert state_store.log_names() == ["a", "s"] and state_store.read_log("s") == b"new"
    assert state_store.log_exists("a") and state_store.log_size("a") == 5
    state_store.remove_log("s")
    state_store.remove_log("never")
    assert state_store.log_names() == ["a"]
    for missing in (lambda: state_store.read_log("s"), lambda: state_store.log_size("s")):
        with pytest.raises(FileNotFoundError):
            missing()


def test_a_private_store_is_separate_and_destroyed_whole(state_store: StateStore) -> None:
    state_store.write_bundle(Area.SESSIONS, "shared", FILES)
    private = state_store.private()
    private.prepare(Area.SESSIONS, exclusive=True)
    private.write_bundle(Area.SESSIONS, "spilled", FILES)
    assert private.bundle_names(Area.SESSIONS) == ["spilled"]
    assert state_store.bundle_names(Area.SESSIONS) == ["shared"]
    private.destroy()
    assert private.bundle_names(Area.SESSIONS) == [] and state_store.bundle_names(Area.SESSIONS) == ["shared"]


def test_the_directory_layout_and_bytes_are_the_single_servers(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    kv = SessionKVData([1, 2], [torch.zeros(2, 1, 2)], [torch.ones(2, 1, 2)])
    content, manifest = SnapshotContent([{"role": "user", "content": "hi"}], kv), {"id": "sess-a", "lsn": 3}
    written = write_snapshot(store, Area.SESSIONS, "sess-a", manifest, content)
    write_snapshot(store, Area.SNAPSHOTS, "snap-b", manifest, content)
    record = encode_record({"type": "delete", "lsn": 4})
    store.prepare(Area.JOURNAL, exclusive=True)
    store.append_log("sess-a", record)
    _, files = encode_snapshot(manifest, content)
    for area, name in ((Area.SESSIONS, "sess-a"), (Area.SNAPSHOTS, "snap-b")):
        directory = tmp_path / area / name
        assert sorted(path.name for path in directory.iterdir()) == sorted(files)
        assert all((directory / file).read_bytes() == data for file, data in files.items() if file != "manifest.json")
    manifest_file = tmp_path / "sessions" / "sess-a" / "manifest.json"
    assert manifest_file.read_bytes() == json.dumps(written, indent=2, ensure_ascii=False).encode()
    assert [path.name for path in (tmp_path / "journal").iterdir()] == ["sess-a.journal"]
    assert (tmp_path / "journal" / "sess-a.journal").read_bytes() == record
    assert sorted(path.name for path in tmp_path.iterdir()) == ["journal", "sessions", "snapshots"]


def test_the_directory_hides_temporaries_and_prepare_puts_back_a_bundle_moved_aside(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    store.write_bundle(Area.SNAPSHOTS, "snap", FILES)
    (tmp_path / "snapshots" / f"{TEMP_PREFIX}half-written-abc").mkdir()  # a crash during a write
    (tmp_path / "snapshots" / "snap").rename(tmp_path / "snapshots" / f"{OLD_PREFIX}snap-0123")  # between two renames
    (tmp_path / "journal").mkdir()
    (tmp_path / "journal" / f"{TEMP_PREFIX}x.journal-123").write_bytes(b"half")
    assert store.bundle_names(Area.SNAPSHOTS) == [] and store.log_names() == []
    store.prepare(Area.SNAPSHOTS, exclusive=True)
    store.prepare(Area.JOURNAL, exclusive=True)
    assert sorted(path.name for path in (tmp_path / "snapshots").iterdir()) == ["snap"]
    assert store.read_file(Area.SNAPSHOTS, "snap", "a.bin") == FILES["a.bin"]
    assert list((tmp_path / "journal").iterdir()) == []


def test_the_router_sees_the_sessions_with_a_saved_bundle_or_a_journal(state_store: StateStore) -> None:
    state_store.write_bundle(Area.SESSIONS, "saved", FILES)
    state_store.write_bundle(Area.SNAPSHOTS, "snap-1", FILES)
    state_store.prepare(Area.JOURNAL, exclusive=True)
    for name in ("journalled", "saved", "-no-id"):
        state_store.append_log(name, b"record")
    stored = StoredSessions(state_store)
    assert stored.session_ids() == {"saved", "journalled"}
    assert stored.has_session("saved") and stored.has_session("journalled")
    assert not any(map(stored.has_session, ("snap-1", "-no-id", "../sessions", "missing")))
