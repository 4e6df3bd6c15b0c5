"""The user's snapshots: a directory per snapshot under the state dir, listed, read, edited and deleted."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from statelm.models.loader import ModelFingerprint
from statelm.sessions.errors import NotFoundError, SnapshotCorruptError, check_id
from statelm.sessions.snapshot_format import (
    SnapshotContent,
    directory_size,
    read_manifest,
    read_snapshot,
    recover_directory,
    rewrite_manifest,
    write_snapshot,
)

METADATA_FIELDS = ("title", "description", "tags")


def new_snapshot_id() -> str:
    """A fresh snapshot id."""
    return f"snap-{uuid.uuid4().hex[:24]}"


class SnapshotStore:
    """Snapshots under one directory; every method does blocking I/O and is meant for a worker thread."""

    def __init__(self, root: Path, model_name: str, fingerprint: ModelFingerprint) -> None:
        self.root = root
        self.model_name = model_name
        self.fingerprint = fingerprint
        root.mkdir(parents=True, exist_ok=True)
        recover_directory(root)

    def create(self, content: SnapshotContent, session_fields: dict[str, Any], metadata: dict[str, Any]) -> dict:
        """Write a new snapshot; returns its manifest (with its size)."""
        snapshot_id = new_snapshot_id()
        manifest = {
            "id": snapshot_id,
            "created": time.time(),
            "model": {"name": self.model_name, "fingerprint": self.fingerprint.parts},
            "metadata": {name: metadata.get(name) for name in METADATA_FIELDS},
            **session_fields,
        }
        directory = self.root / snapshot_id
        return self._with_size(directory, write_snapshot(directory, manifest, content))

    def list(self) -> list[dict[str, Any]]:
        """Manifests of every readable snapshot, oldest first; damaged ones are listed as corrupt."""
        manifests = []
        for directory in sorted(self.root.iterdir()):
            if directory.name.startswith(".") or not directory.is_dir():
                continue
            try:
                manifests.append(self._with_size(directory, read_manifest(directory)))
            except SnapshotCorruptError as exc:
                manifests.append({"id": directory.name, "created": 0, "corrupt": exc.message})
        return sorted(manifests, key=lambda manifest: manifest.get("created", 0))

    def get(self, snapshot_id: str) -> dict[str, Any]:
        """One snapshot's manifest."""
        directory = self._directory(snapshot_id)
        return self._with_size(directory, read_manifest(directory))

    def update(self, snapshot_id: str, changes: dict[str, Any]) -> dict[str, Any]:
        """Set (or, with None, clear) metadata fields; returns the new manifest."""
        directory = self._directory(snapshot_id)
        manifest = read_manifest(directory)
        manifest["metadata"] = {**manifest.get("metadata", {}), **changes}
        rewrite_manifest(directory, manifest)
        return self._with_size(directory, manifest)

    def delete(self, snapshot_id: str) -> None:
        """Remove a snapshot."""
        shutil.rmtree(self._directory(snapshot_id))

    def read(self, snapshot_id: str) -> tuple[dict[str, Any], SnapshotContent]:
        """A snapshot's manifest and verified content."""
        return read_snapshot(self._directory(snapshot_id), self.fingerprint)

    def _directory(self, snapshot_id: str) -> Path:
        directory = self.root / check_id(snapshot_id, "snapshot_id")
        if not directory.is_dir():
            raise NotFoundError(f"snapshot {snapshot_id!r} does not exist", param="snapshot_id")
        return directory

    @staticmethod
    def _with_size(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """The manifest with the id taken from the directory name (never the reverse) and the size on disk."""
        return {**manifest, "id": directory.name, "size_bytes": directory_size(directory)}
