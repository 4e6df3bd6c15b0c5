"""The snapshot directory format and store: atomic writes, verification on read, metadata edits, ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from statelm.engine.session_kv import SessionKVData
from statelm.models.loader import ModelFingerprint
from statelm.sessions.errors import (
    FingerprintMismatchError,
    InvalidIdError,
    NotFoundError,
    SnapshotCorruptError,
    check_id,
)
from statelm.sessions.snapshot_format import (
    SnapshotContent,
    read_snapshot,
    read_transcript,
    write_snapshot,
)
from statelm.sessions.snapshots import SnapshotStore
from statelm.sessions.temporaries import clean_temporaries

FINGERPRINT = ModelFingerprint({"config": "c", "weights": "w", "dtype": "bfloat16", "tokenizer": "t"})
TRANSCRIPT = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}]


def content(num_tokens: int = 5) -> SnapshotContent:
    keys = [torch.randn(num_tokens, 2, 4, dtype=torch.bfloat16) for _ in range(3)]
    values = [torch.randn(num_tokens, 2, 4, dtype=torch.bfloat16) for _ in range(3)]
    return SnapshotContent(TRANSCRIPT, SessionKVData(list(range(num_tokens)), keys, values))


def write(directory: Path, snapshot: SnapshotContent | None = None) -> SnapshotContent:
    snapshot = snapshot or content()
    write_snapshot(directory, {"model": {"name": "m", "fingerprint": FINGERPRINT.parts}}, snapshot)
    return snapshot


def test_round_trip_keeps_tokens_transcript_and_kv_bit_for_bit(tmp_path: Path) -> None:
    written = write(tmp_path / "snap")
    manifest, read = read_snapshot(tmp_path / "snap", FINGERPRINT)
    assert manifest["num_tokens"] == 5 and manifest["num_messages"] == 2 and manifest["schema_version"] == 1
    assert read.transcript == TRANSCRIPT and read.kv.tokens == written.kv.tokens
    for ours, theirs in zip(read.kv.keys + read.kv.values, written.kv.keys + written.kv.values, strict=True):
        assert torch.equal(ours, theirs)
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == [
        "kv.safetensors",
        "manifest.json",
        "tokens.json",
        "transcript.json",
    ]
    assert read_transcript(tmp_path / "snap", FINGERPRINT)[1] == TRANSCRIPT


def test_an_empty_session_round_trips(tmp_path: Path) -> None:
    write(tmp_path / "empty", content(0))
    _, read = read_snapshot(tmp_path / "empty", FINGERPRINT)
    assert read.kv.tokens == [] and read.kv.keys[0].shape == (0, 2, 4)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "tokens"])
def test_damaged_files_are_reported_as_corrupt(tmp_path: Path, damage: str) -> None:
    write(tmp_path / "snap")
    kv_file = tmp_path / "snap" / "kv.safetensors"
    data = bytearray(kv_file.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x01
        kv_file.write_bytes(bytes(data))
    elif damage == "truncate":
        kv_file.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "delete":
        kv_file.unlink()
    else:
        (tmp_path / "snap" / "tokens.json").write_text("[1, 2]")
    with pytest.raises(SnapshotCorruptError):
        read_snapshot(tmp_path / "snap", FINGERPRINT)


def test_unknown_schema_and_foreign_model_are_refused(tmp_path: Path) -> None:
    write(tmp_path / "snap")
    other = ModelFingerprint({**FINGERPRINT.parts, "dtype": "float16", "tokenizer": "x"})
    with pytest.raises(FingerprintMismatchError, match="dtype, tokenizer"):
        read_snapshot(tmp_path / "snap", other)
    manifest_file = tmp_path / "snap" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps({**manifest, "schema_version": 99}))
    with pytest.raises(SnapshotCorruptError, match="schema version 99"):
        read_snapshot(tmp_path / "snap", FINGERPRINT)
    manifest_file.write_text("{not json")
    with pytest.raises(SnapshotCorruptError):
        read_snapshot(tmp_path / "snap", FINGERPRINT)


def test_rewriting_replaces_the_directory_and_a_crash_mid_write_leaves_nothing_visible(tmp_path: Path) -> None:
    write(tmp_path / "snap", content(3))
    write(tmp_path / "snap", content(7))
    assert read_snapshot(tmp_path / "snap", FINGERPRINT)[0]["num_tokens"] == 7
    (tmp_path / ".tmp-half-written-abc").mkdir()  # what a crash during write_snapshot leaves
    (tmp_path / "snap").rename(tmp_path / ".old-snap-0123")  # a crash between the two renames of a rewrite
    clean_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]
    assert read_snapshot(tmp_path / "snap", FINGERPRINT)[0]["num_tokens"] == 7


def test_store_lists_edits_and_deletes(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snapshots", "m", FINGERPRINT)
    created = store.create(content(), {"session": {"id": "s"}}, {"title": "a", "description": "b", "tags": ["x"]})
    snapshot_id = created["id"]
    assert created["size_bytes"] > 0 and created["session"]["id"] == "s"
    updated = store.update(snapshot_id, {"title": "new", "tags": None})
    assert updated["metadata"] == {"title": "new", "description": "b", "tags": None}
    assert store.get(snapshot_id)["metadata"]["title"] == "new"
    assert [entry["id"] for entry in store.list()] == [snapshot_id]
    assert store.read(snapshot_id)[1].transcript == TRANSCRIPT
    store.delete(snapshot_id)
    with pytest.raises(NotFoundError):
        store.get(snapshot_id)
    with pytest.raises(InvalidIdError):
        store.get("../snapshots")


@pytest.mark.parametrize("value", ["../x", "/abs", "a/b", "..", ".", ".dot", "", "a" * 129, "tab\t", "nul\0"])
def test_ids_that_could_name_paths_are_invalid(value: str) -> None:
    with pytest.raises(InvalidIdError):
        check_id(value, "session_id")


def test_ordinary_ids_are_valid() -> None:
    for value in ("a", "sess-1", "My_Session.v2", "0" * 128):
        assert check_id(value, "session_id") == value
