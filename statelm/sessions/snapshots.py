"""The user's snapshots: a directory per snapshot under the state dir, listed, read, edited and deleted."""

from __future__ import annotations

import contextlib
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from statelm.models.loader import ModelFingerprint
from statelm.sessions.errors import NotFoundError, SnapshotCorruptError, check_id
from statelm.sessions.ownership import LOCAL, LOCAL_OWNER, Principal, recorded_owner
from statelm.sessions.snapshot_format import (
    SnapshotContent,
    directory_size,
    read_manifest,
    read_snapshot,
    rewrite_manifest,
    write_snapshot,
)
from statelm.sessions.temporaries import clean_temporaries

METADATA_FIELDS = ("title", "description", "tags")


def new_snapshot_id() -> str:
    """A fresh snapshot id."""
    return f"snap-{uuid.uuid4().hex[:24]}"


class SnapshotStore:
    """Snapshots under one directory, each visible only to its owner (and admins).

    Every method does blocking I/O and is meant for a worker thread. Methods act for a viewer (the local
    user when none is given); a snapshot the viewer may not touch is reported as missing, exactly like one
    that does not exist.
    """

    def __init__(self, root: Path, model_name: str, fingerprint: ModelFingerprint, exclusive: bool = True) -> None:
        self.root = root
        self.model_name = model_name
        self.fingerprint = fingerprint
        root.mkdir(parents=True, exist_ok=True)
        clean_temporaries(root, exclusive)  # shared with other servers (not exclusive): only abandoned ones

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
        directory = self.root / snapshot_id
        return self._with_size(directory, write_snapshot(directory, manifest, content, max_bytes))

    def list(self, viewer: Principal = LOCAL) -> list[dict[str, Any]]:
        """Manifests of the snapshots viewer may see, oldest first; damaged ones (admins only) as corrupt."""
        manifests = []
        for directory in self._directories():
            with contextlib.suppress(NotFoundError):  # deleted while listing
                manifest = self._listed(directory, viewer)
                if manifest is not None:
                    manifests.append(manifest)
        return sorted(manifests, key=lambda manifest: manifest.get("created", 0))

    def usage(self, owner: str) -> int:
        """Bytes on disk of the snapshots owner created."""
        total = 0
        for directory in self._directories():
            with contextlib.suppress(SnapshotCorruptError, FileNotFoundError):
                if recorded_owner(read_manifest(directory)) == owner:
                    total += directory_size(directory)
        return total

    def get(self, snapshot_id: str, viewer: Principal = LOCAL) -> dict[str, Any]:
        """One snapshot's manifest."""
        directory, manifest = self._accessible(snapshot_id, viewer)
        return self._with_size(directory, manifest)

    def update(self, snapshot_id: str, changes: dict[str, Any], viewer: Principal = LOCAL) -> dict[str, Any]:
        """Set (or, with None, clear) metadata fields; returns the new manifest."""
        directory, manifest = self._accessible(snapshot_id, viewer)
        manifest["metadata"] = {**manifest.get("metadata", {}), **changes}
        with _deleted_meanwhile(snapshot_id):
            rewrite_manifest(directory, manifest)
        return self._with_size(directory, manifest)

    def delete(self, snapshot_id: str, viewer: Principal = LOCAL) -> None:
        """Remove a snapshot; admins may also remove one whose manifest is damaged."""
        directory = self._directory(snapshot_id)
        if not viewer.admin:
            self._accessible(snapshot_id, viewer)
        with _deleted_meanwhile(snapshot_id):
            shutil.rmtree(directory)

    def read(self, snapshot_id: str, viewer: Principal = LOCAL) -> tuple[dict[str, Any], SnapshotContent]:
        """A snapshot's manifest and verified content."""
        directory, _ = self._accessible(snapshot_id, viewer)
        return read_snapshot(directory, self.fingerprint)

    def _listed(self, directory: Path, viewer: Principal) -> dict[str, Any] | None:
        """A directory's manifest as a listing shows it to viewer; None if viewer may not see it."""
        try:
            manifest = read_manifest(directory)
        except SnapshotCorruptError as exc:
            if not directory.is_dir():
                raise _missing(directory.name) from None
            return {"id": directory.name, "created": 0, "corrupt": exc.message} if viewer.admin else None
        return self._with_size(directory, manifest) if viewer.may_access(recorded_owner(manifest)) else None

    def _directories(self) -> list[Path]:
        return [entry for entry in sorted(self.root.iterdir()) if not entry.name.startswith(".") and entry.is_dir()]

    def _directory(self, snapshot_id: str) -> Path:
        directory = self.root / check_id(snapshot_id, "snapshot_id")
        if not directory.is_dir():
            raise _missing(snapshot_id)
        return directory

    def _accessible(self, snapshot_id: str, viewer: Principal) -> tuple[Path, dict[str, Any]]:
        """Directory and manifest of a snapshot viewer may touch; a damaged one is corrupt to admins only."""
        directory = self._directory(snapshot_id)
        try:
            manifest = read_manifest(directory)
        except SnapshotCorruptError:
            if viewer.admin and directory.is_dir():
                raise
            raise _missing(snapshot_id) from None
        if not viewer.may_access(recorded_owner(manifest)):
            raise _missing(snapshot_id)
        return directory, manifest

    @staticmethod
    def _with_size(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """The manifest with the id taken from the directory name (never the reverse) and the size on disk."""
        with _deleted_meanwhile(directory.name):
            return {**manifest, "id": directory.name, "size_bytes": directory_size(directory)}


def _missing(snapshot_id: str) -> NotFoundError:
    return NotFoundError(f"snapshot {snapshot_id!r} does not exist", param="snapshot_id")


@contextlib.contextmanager
def _deleted_meanwhile(snapshot_id: str) -> Iterator[None]:
    """A snapshot directory that vanishes under a request (a concurrent delete) is a missing snapshot."""
    try:
        yield
    except FileNotFoundError:
        raise _missing(snapshot_id) from None
