"""The snapshot format and store: atomic writes, verification on read, metadata edits, ids."""

from __future__ import annotations

import json

import pytest
import torch

from statelm.attention.kv_format import encode_rows, kv_format
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
    KV,
    MANIFEST,
    TOKENS,
    TRANSCRIPT,
    SnapshotContent,
    read_snapshot,
    read_transcript,
    write_snapshot,
)
from statelm.sessions.snapshots import SnapshotStore
from statelm.sessions.state_store import Area, StateStore

FINGERPRINT = ModelFingerprint({"config": "c", "weights": "w", "dtype": "bfloat16", "tokenizer": "t"})
MESSAGES = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}]


def content(num_tokens: int = 5) -> SnapshotContent:
    keys = [torch.randn(num_tokens, 2, 4, dtype=torch.bfloat16) for _ in range(3)]
    values = [torch.randn(num_tokens, 2, 4, dtype=torch.bfloat16) for _ in range(3)]
    return SnapshotContent(MESSAGES, SessionKVData(list(range(num_tokens)), keys, values))


def write(store: StateStore, name: str, snapshot: SnapshotContent | None = None) -> SnapshotContent:
    snapshot = snapshot or content()
    write_snapshot(store, Area.SNAPSHOTS, name, {"model": {"name": "m", "fingerprint": FINGERPRINT.parts}}, snapshot)
    return snapshot


def read(store: StateStore, name: str, fingerprint: ModelFingerprint = FINGERPRINT) -> tuple[dict, SnapshotContent]:
    return read_snapshot(store, Area.SNAPSHOTS, name, fingerprint)


def test_round_trip_keeps_tokens_transcript_and_kv_bit_for_bit(state_store: StateStore) -> None:
    written = write(state_store, "snap")
    manifest, snapshot = read(state_store, "snap")
    assert manifest["num_tokens"] == 5 and manifest["num_messages"] == 2 and manifest["schema_version"] == 2
    assert manifest["kv_dtype"] == "bfloat16"
    assert snapshot.transcript == MESSAGES and snapshot.kv.tokens == written.kv.tokens
    for ours, theirs in zip(snapshot.kv.keys + snapshot.kv.values, written.kv.keys + written.kv.values, strict=True):
        assert torch.equal(ours, theirs)
    for file in (KV, MANIFEST, TOKENS, TRANSCRIPT):
        assert state_store.read_file(Area.SNAPSHOTS, "snap", file)
    assert state_store.bundle_size(Area.SNAPSHOTS, "snap") == sum(
        len(state_store.read_file(Area.SNAPSHOTS, "snap", file)) for file in (KV, MANIFEST, TOKENS, TRANSCRIPT)
    )  # those four files and no other
    assert read_transcript(state_store, Area.SNAPSHOTS, "snap", FINGERPRINT)[1] == MESSAGES


def test_an_empty_session_round_trips(state_store: StateStore) -> None:
    write(state_store, "empty", content(0))
    _, snapshot = read(state_store, "empty")
    assert snapshot.kv.tokens == [] and snapshot.kv.keys[0].shape == (0, 2, 4)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "tokens"])
def test_damaged_files_are_reported_as_corrupt(state_store: StateStore, damage: str) -> None:
    write(state_store, "snap")
    data = bytearray(state_store.read_file(Area.SNAPSHOTS, "snap", KV))
    if damage == "flip":
        data[-3] ^= 0x01
        state_store.replace_file(Area.SNAPSHOTS, "snap", KV, bytes(data))
    elif damage == "truncate":
        state_store.replace_file(Area.SNAPSHOTS, "snap", KV, bytes(data[: len(data) // 2]))
    elif damage == "delete":
        rest = {file: state_store.read_file(Area.SNAPSHOTS, "snap", file) for file in (MANIFEST, TOKENS, TRANSCRIPT)}
        state_store.write_bundle(Area.SNAPSHOTS, "snap", rest)
    else:
        state_store.replace_file(Area.SNAPSHOTS, "snap", TOKENS, b"[1, 2]")
    with pytest.raises(SnapshotCorruptError):
        read(state_store, "snap")


def test_unknown_schema_and_foreign_model_are_refused(state_store: StateStore) -> None:
    write(state_store, "snap")
    other = ModelFingerprint({**FINGERPRINT.parts, "dtype": "float16", "tokenizer": "x"})
    with pytest.raises(FingerprintMismatchError, match="dtype, tokenizer"):
        read(state_store, "snap", other)
    manifest = json.loads(state_store.read_file(Area.SNAPSHOTS, "snap", MANIFEST))
    state_store.replace_file(Area.SNAPSHOTS, "snap", MANIFEST, json.dumps({**manifest, "schema_version": 99}).encode())
    with pytest.raises(SnapshotCorruptError, match="schema version 99"):
        read(state_store, "snap")
    state_store.replace_file(Area.SNAPSHOTS, "snap", MANIFEST, b"{not json")
    with pytest.raises(SnapshotCorruptError, match="manifest is unreadable"):
        read(state_store, "snap")
    state_store.write_bundle(Area.SNAPSHOTS, "snap", {})
    with pytest.raises(SnapshotCorruptError, match="manifest is unreadable"):
        read(state_store, "snap")


def test_rewriting_replaces_the_snapshot(state_store: StateStore) -> None:
    write(state_store, "snap", content(3))
    write(state_store, "snap", content(7))
    assert read(state_store, "snap")[0]["num_tokens"] == 7
    assert state_store.bundle_names(Area.SNAPSHOTS) == ["snap"]


def test_store_lists_edits_and_deletes(state_store: StateStore) -> None:
    store = SnapshotStore(state_store, "m", FINGERPRINT)
    created = store.create(content(), {"session": {"id": "s"}}, {"title": "a", "description": "b", "tags": ["x"]})
    snapshot_id = created["id"]
    assert created["size_bytes"] > 0 and created["session"]["id"] == "s"
    updated = store.update(snapshot_id, {"title": "new", "tags": None})
    assert updated["metadata"] == {"title": "new", "description": "b", "tags": None}
    assert store.get(snapshot_id)["metadata"]["title"] == "new"
    assert [entry["id"] for entry in store.list()] == [snapshot_id]
    assert store.read(snapshot_id)[1].transcript == MESSAGES
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


# --- KV formats: rows in the pool's format; schema 1 snapshots; another format refused, never converted -----------

SERVED = {"config": "c", "weights": "w", "dtype": "float32", "tokenizer": "t"}  # a float32 model


def served_with(kv: str) -> ModelFingerprint:
    """The fingerprint of the float32 model served with a KV cache of format kv."""
    return ModelFingerprint({**SERVED, "kv_cache_dtype": kv})


def kv_content(kv: str, num_tokens: int = 6) -> SnapshotContent:
    """A snapshot's content holding random K/V stored in format kv."""
    gen = torch.Generator().manual_seed(len(kv))
    rows = [encode_rows(torch.randn(num_tokens, 2, 64, generator=gen), kv_format(kv)) for _ in range(4)]
    return SnapshotContent(MESSAGES, SessionKVData(list(range(num_tokens)), rows[:2], rows[2:]))


def write_made_with(store: StateStore, kv: str, schema: int = 2, parts: dict[str, str] | None = None) -> None:
    """A snapshot made by the float32 model with KV format kv; schema 1 as it was written (no kv_dtype)."""
    parts = parts if parts is not None else served_with(kv).parts
    write_snapshot(store, Area.SNAPSHOTS, "snap", {"model": {"name": "m", "fingerprint": parts}}, kv_content(kv))
    if schema == 1:
        manifest = json.loads(store.read_file(Area.SNAPSHOTS, "snap", MANIFEST))
        del manifest["kv_dtype"]
        manifest["schema_version"] = 1
        store.replace_file(Area.SNAPSHOTS, "snap", MANIFEST, json.dumps(manifest).encode())


@pytest.mark.parametrize("kv", ["float32", "float16", "bfloat16", "q8_0"])
def test_kv_is_stored_in_the_pools_format_and_read_back_bit_for_bit(state_store: StateStore, kv: str) -> None:
    write_made_with(state_store, kv)
    manifest, snapshot = read(state_store, "snap", served_with(kv))
    written = kv_content(kv)
    assert manifest["kv_dtype"] == kv and snapshot.kv.kv_format == kv_format(kv)
    for ours, theirs in zip(snapshot.kv.keys + snapshot.kv.values, written.kv.keys + written.kv.values, strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_16_bit_snapshots_take_half_and_q8_0_ones_about_a_quarter_of_float32_ones(state_store: StateStore) -> None:
    sizes = {}
    for kv in ("float32", "float16", "q8_0"):
        write_snapshot(state_store, Area.SNAPSHOTS, kv, {"model": {"fingerprint": served_with(kv).parts}},
                       kv_content(kv, 64))  # fmt: skip
        sizes[kv] = len(state_store.read_file(Area.SNAPSHOTS, kv, KV))
    assert sizes["float16"] < 0.51 * sizes["float32"] and sizes["q8_0"] < 0.28 * sizes["float32"]


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_schema_1_snapshots_load_into_a_pool_of_their_format(state_store: StateStore, kv: str) -> None:
    write_made_with(state_store, kv, schema=1)
    manifest, snapshot = read(state_store, "snap", served_with(kv))
    assert manifest["schema_version"] == 1 and snapshot.kv.kv_format == kv_format(kv)


def test_the_oldest_snapshots_name_their_kv_by_the_models_dtype(state_store: StateStore) -> None:
    write_made_with(state_store, "float32", schema=1, parts=dict(SERVED))  # before kv_cache_dtype joined it
    assert read(state_store, "snap", served_with("float32"))[1].kv.kv_format == kv_format("float32")
    with pytest.raises(FingerprintMismatchError, match="--kv-cache-dtype float32"):
        read(state_store, "snap", served_with("float16"))


@pytest.mark.parametrize("schema", [1, 2])
@pytest.mark.parametrize(
    ("made", "served"), [("float32", "float16"), ("float32", "q8_0"), ("float16", "bfloat16"), ("q8_0", "float32")]
)
def test_kv_of_another_format_is_refused_naming_the_setting_that_loads_it(
    state_store: StateStore, made: str, served: str, schema: int
) -> None:
    if schema == 1 and made == "q8_0":
        pytest.skip("schema 1 had no q8_0")
    write_made_with(state_store, made, schema)
    with pytest.raises(FingerprintMismatchError, match=f"--kv-cache-dtype {made} loads it") as refused:
        read(state_store, "snap", served_with(served))
    assert refused.value.code == "fingerprint_mismatch" and f"this server keeps {served} KV" in refused.value.message
    assert read_transcript(state_store, Area.SNAPSHOTS, "snap", served_with(served))[1] == MESSAGES


def test_other_differences_are_refused_with_the_kv_format_named_among_them(state_store: StateStore) -> None:
    write_made_with(state_store, "float32")
    other = ModelFingerprint({**SERVED, "weights": "other", "kv_cache_dtype": "float16"})
    with pytest.raises(FingerprintMismatchError, match="kv_cache_dtype, weights"):
        read(state_store, "snap", other)
    with pytest.raises(FingerprintMismatchError, match=r"in: weights$"):
        read_transcript(state_store, Area.SNAPSHOTS, "snap", other)


def test_kv_of_another_format_than_its_manifest_says_is_corrupt(state_store: StateStore) -> None:
    write_made_with(state_store, "float16")
    manifest = json.loads(state_store.read_file(Area.SNAPSHOTS, "snap", MANIFEST))
    state_store.replace_file(Area.SNAPSHOTS, "snap", MANIFEST, json.dumps({**manifest, "kv_dtype": "float32"}).encode())
    with pytest.raises(SnapshotCorruptError, match="not the manifest's"):
        read(state_store, "snap", served_with("float32"))
