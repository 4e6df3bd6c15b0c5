"""The user's snapshots: a bundle per snapshot in the state store's SNAPSHOTS area, listed, read, edited and deleted."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

from statelm.models.loader import ModelFingerprint
from statelm.sessions.errors import NotFoundError, SnapshotCorruptError, check_id
from statelm.sessions.ownership import LOCAL, LOCAL_OWNER, Principal, recorded_owner
from statelm.sessions.snapshot_format import (
    SnapshotContent,
    read_manifest,
    read_snapshot,
    rewrite_manifest,
    write_snapshot,
)
from statelm.sessions.state_store import Area, StateStore

METADATA_FIELDS = ("title", "description", "tags")


def new_snapshot_id() -> str:
    """A fresh snapshot id."""
    return f"snap-{uuid.uuid4().hex[:24]}"


class SnapshotStore:
    """The snapshots of a state store, each visible only to its owner (and admins).

    Every method does blocking I/O and is meant for a worker thread. Methods act for a viewer (the local
    user when none is given); a snapshot the viewer may not touch is reported as missing, exactly like one
    that does not exist.
    """

    def __init__(
        self, store: StateStore, model_name: str, fingerprint: ModelFingerprint, exclusive: bool = True
    ) -> None:
        self.store = store
        self.model_name = model_name
        self.fingerprint = fingerprint
        store.prepare(Area.SNAPSHOTS, exclusive)  # shared with other servers (not exclusive): only abandoned writes

    def create(
        self,
        content: SnapshotContent,
        session_fields: dict[str, Any],
        metadata: dict[str, Any],
        owner: str = LOCAL_OWNER,
        max_bytes: int | None = None,
    ) -> dict[str, Any]:
        """Write a new snapshot owned by owner, if it fits in max_bytes; returns its manifest (with its size)."""
        snapshot_id = new_snapshot_id()
        manifest = {
            "id": snapshot_id,
            "created": time.time(),
            "owner": owner,
            "model": {"name": self.model_name, "fingerprint": self.fingerprint.parts},
            "metadata": {name: metadata.get(name) for name in METADATA_FIELDS},
            **session_fields,
        }
        written = write_snapshot(self.store, Area.SNAPSHOTS, snapshot_id, manifest, content, max_bytes)
        return self._with_size(snapshot_id, written)

    def list(self, viewer: Principal = LOCAL) -> list[dict[str, Any]]:
        """Manifests of the snapshots viewer may see, oldest first; damaged ones (admins only) as corrupt."""
        manifests = []
        for snapshot_id in self.store.bundle_names(Area.SNAPSHOTS):
            with contextlib.suppress(NotFoundError):  # deleted while listing
                manifest = self._listed(snapshot_id, viewer)
                if manifest is not None:
                    manifests.append(manifest)
        return sorted(manifests, key=lambda manifest: manifest.get("created", 0))

    def usage(self, owner: str) -> int:
        """Bytes in the store of the snapshots owner created."""
        total = 0
        for snapshot_id in self.store.bundle_names(Area.SNAPSHOTS):
            with contextlib.suppress(SnapshotCorruptError, FileNotFoundError):
                if recorded_owner(read_manifest(self.store, Area.SNAPSHOTS, snapshot_id)) == owner:
                    total += self.store.bundle_size(Area.SNAPSHOTS, snapshot_id)
        return total

    def get(self, snapshot_id: str, viewer: Principal = LOCAL) -> dict[str, Any]:
        """One snapshot's manifest."""
        return self._with_size(snapshot_id, self._accessible(snapshot_id, viewer))

    def update(self, snapshot_id: str, changes: dict[str, Any], viewer: Principal = LOCAL) -> dict[str, Any]:
        """Set (or, with None, clear) metadata fields; returns the new manifest."""
        manifest = self._accessible(snapshot_id, viewer)
        manifest["metadata"] = {**manifest.get("metadata", {}), **changes}
        with _deleted_meanwhile(snapshot_id):
            rewrite_manifest(self.store, Area.SNAPSHOTS, snapshot_id, manifest)
        return self._with_size(snapshot_id, manifest)

    def delete(self, snapshot_id: str, viewer: Principal = LOCAL) -> None:
        """Remove a snapshot; admins may also remove one whose manifest is damaged."""
        self._existing(snapshot_id)
        if not viewer.admin:
            self._accessible(snapshot_id, viewer)
        with _deleted_meanwhile(snapshot_id):
            self.store.delete_bundle(Area.SNAPSHOTS, snapshot_id)

    def read(self, snapshot_id: str, viewer: Principal = LOCAL) -> tuple[dict[str, Any], SnapshotContent]:
        """A snapshot's manifest and verified content."""
        self._accessible(snapshot_id, viewer)
        return read_snapshot(self.store, Area.SNAPSHOTS, snapshot_id, self.fingerprint)

    def _listed(self, snapshot_id: str, viewer: Principal) -> dict[str, Any] | None:
        """A snapshot's manifest as a listing shows it to viewer; None if viewer may not see it."""
        try:
            manifest = read_manifest(self.store, Area.SNAPSHOTS, snapshot_id)
        except SnapshotCorruptError as exc:
            if not self.store.bundle_exists(Area.SNAPSHOTS, snapshot_id):
                raise _missing(snapshot_id) from None
            return {"id": snapshot_id, "created": 0, "corrupt": exc.message} if viewer.admin else None
        return self._with_size(snapshot_id, manifest) if viewer.may_access(recorded_owner(manifest)) else None

    def _existing(self, snapshot_id: str) -> None:
        """NotFoundError unless the store holds a snapshot of that (valid) id."""
        if not self.store.bundle_exists(Area.SNAPSHOTS, check_id(snapshot_id, "snapshot_id")):
            raise _missing(snapshot_id)

    def _accessible(self, snapshot_id: str, viewer: Principal) -> dict[str, Any]:
        """The manifest of a snapshot viewer may touch; a damaged one is corrupt to admins only."""
        self._existing(snapshot_id)
        try:
            manifest = read_manifest(self.store, Area.SNAPSHOTS, snapshot_id)
        except SnapshotCorruptError:
            if viewer.admin and self.store.bundle_exists(Area.SNAPSHOTS, snapshot_id):
                raise
            raise _missing(snapshot_id) from None
        if not viewer.may_access(recorded_owner(manifest)):
            raise _missing(snapshot_id)
        return manifest

    def _with_size(self, snapshot_id: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """The manifest with the id taken from the bundle's name (never the reverse) and its size in the store."""
        with _deleted_meanwhile(snapshot_id):
            return {**manifest, "id": snapshot_id, "size_bytes": self.store.bundle_size(Area.SNAPSHOTS, snapshot_id)}


def _missing(snapshot_id: str) -> NotFoundError:
    return NotFoundError(f"snapshot {snapshot_id!r} does not exist", param="snapshot_id")


@contextlib.contextmanager
def _deleted_meanwhile(snapshot_id: str) -> Iterator[None]:
    """A snapshot that vanishes under a request (a concurrent delete) is a missing snapshot."""
    try:
        yield
    except FileNotFoundError:
        raise _missing(snapshot_id) from None
