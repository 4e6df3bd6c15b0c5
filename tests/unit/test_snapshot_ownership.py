"""Snapshots belong to the key that made them: others see nothing, admins see all, quotas stop a write."""

from __future__ import annotations

import json

import pytest
import torch

from statelm.engine.session_kv import SessionKVData
from statelm.models.loader import ModelFingerprint
from statelm.sessions.errors import NotFoundError, SnapshotCorruptError, SnapshotQuotaError
from statelm.sessions.ownership import LOCAL_OWNER, Principal, acting_as, current_principal, recorded_owner
from statelm.sessions.snapshot_format import MANIFEST, SnapshotContent
from statelm.sessions.snapshots import SnapshotStore
from statelm.sessions.state_store import Area, StateStore

FINGERPRINT = ModelFingerprint({"config": "c", "weights": "w", "dtype": "bfloat16", "tokenizer": "t"})
ALICE, BOB, ADMIN = Principal("sha256:a"), Principal("sha256:b"), Principal("sha256:admin", admin=True)


def content(num_tokens: int = 4) -> SnapshotContent:
    keys, values = ([torch.zeros(num_tokens, 2, 4, dtype=torch.bfloat16) for _ in range(2)] for _ in range(2))
    kv = SessionKVData(list(range(num_tokens)), keys, values)
    return SnapshotContent([{"role": "user", "content": "hi"}], kv)


@pytest.fixture
def store(state_store: StateStore) -> SnapshotStore:
    return SnapshotStore(state_store, "m", FINGERPRINT)


def test_only_the_owner_and_admins_see_a_snapshot(store: SnapshotStore) -> None:
    snapshot_id = store.create(content(), {}, {}, ALICE.owner)["id"]
    assert [entry["id"] for entry in store.list(ALICE)] == [snapshot_id]
    assert [entry["id"] for entry in store.list(ADMIN)] == [snapshot_id]
    assert store.list(BOB) == []
    for operation in (
        lambda: store.get(snapshot_id, BOB),
        lambda: store.update(snapshot_id, {"title": "mine"}, BOB),
        lambda: store.read(snapshot_id, BOB),
        lambda: store.delete(snapshot_id, BOB),
    ):
        with pytest.raises(NotFoundError):
            operation()
    assert store.get(snapshot_id, ALICE)["metadata"]["title"] is None
    store.update(snapshot_id, {"title": "checked"}, ADMIN)
    assert store.read(snapshot_id, ALICE)[0]["metadata"]["title"] == "checked"
    store.delete(snapshot_id, ADMIN)
    assert store.list(ALICE) == []


def test_a_damaged_manifest_is_missing_to_users_and_corrupt_to_admins(store: SnapshotStore) -> None:
    snapshot_id = store.create(content(), {}, {}, ALICE.owner)["id"]
    store.store.replace_file(Area.SNAPSHOTS, snapshot_id, MANIFEST, b"{")
    assert store.list(ALICE) == []
    assert store.list(ADMIN)[0]["corrupt"]
    with pytest.raises(NotFoundError):
        store.get(snapshot_id, ALICE)
    with pytest.raises(SnapshotCorruptError):
        store.get(snapshot_id, ADMIN)
    store.delete(snapshot_id, ADMIN)
    assert store.list(ADMIN) == []


def test_quota_refuses_a_snapshot_that_does_not_fit_before_writing_it(store: SnapshotStore) -> None:
    first = store.create(content(), {}, {}, ALICE.owner)
    assert store.usage(ALICE.owner) == first["size_bytes"] and store.usage(BOB.owner) == 0
    margin = 64  # two snapshots of the same content differ by a few bytes (id, timestamp digits in the manifest)
    with pytest.raises(SnapshotQuotaError):
        store.create(content(), {}, {}, ALICE.owner, max_bytes=first["size_bytes"] - margin)
    assert len(store.store.bundle_names(Area.SNAPSHOTS)) == 1
    second = store.create(content(), {}, {}, ALICE.owner, max_bytes=first["size_bytes"] + margin)
    assert store.usage(ALICE.owner) == first["size_bytes"] + second["size_bytes"]


def test_state_from_before_owners_belongs_to_the_local_user(store: SnapshotStore) -> None:
    snapshot_id = store.create(content(), {}, {}, ALICE.owner)["id"]
    manifest = json.loads(store.store.read_file(Area.SNAPSHOTS, snapshot_id, MANIFEST))
    del manifest["owner"]
    store.store.replace_file(Area.SNAPSHOTS, snapshot_id, MANIFEST, json.dumps(manifest).encode())
    assert recorded_owner(manifest) == LOCAL_OWNER and recorded_owner({"owner": 7}) == LOCAL_OWNER
    assert store.list(ALICE) == [] and [entry["id"] for entry in store.list()] == [snapshot_id]


def test_the_current_principal_is_scoped_to_a_block() -> None:
    assert current_principal().owner == LOCAL_OWNER and current_principal().admin
    with acting_as(BOB):
        assert current_principal() is BOB
    assert current_principal().owner == LOCAL_OWNER
