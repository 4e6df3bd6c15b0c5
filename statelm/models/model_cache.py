"""A disk cache of converted models: JSON metadata plus memory-mapped safetensors weights, keyed by source file."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from statelm.paths import APP_NAME

# Bump when the layout of an entry changes; entries of another version are misses and get replaced.
FORMAT_VERSION = 1
CACHE_DIR_ENV = "STATELM_CACHE_DIR"
MANIFEST = "manifest.json"
METADATA = "metadata.json"
TENSORS = "tensors.safetensors"
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
# prune() removes temporary directories of interrupted stores once they are this old.
_LEFTOVER_AGE_S = 3600.0
_PUBLISH_ATTEMPTS = 3

log = logging.getLogger(__name__)


class _DamagedEntry(ValueError):
    """A cache entry whose files do not match its manifest."""


@dataclass
class CachedModel:
    """A converted model read back from the cache: metadata, and tensors memory-mapped from disk."""

    metadata: dict[str, Any]
    tensors: dict[str, torch.Tensor]


def default_cache_root() -> Path:
    """`$STATELM_CACHE_DIR/models` when that is set, else `models` in the per-user cache directory."""
    base = os.environ.get(CACHE_DIR_ENV)
    return (Path(base).expanduser() if base else Path(platformdirs.user_cache_dir(APP_NAME))) / "models"


class ModelCache:
    """Converted models on disk, one directory per (source file, variant), written atomically."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_root()

    def key(self, source: Path, variant: str) -> str:
        """The entry name of a source file and variant: a hex digest of its resolved path and the variant."""
        ident = json.dumps([str(Path(source).resolve()), variant])
        return hashlib.sha256(ident.encode()).hexdigest()[:32]

    def load(self, source: Path, variant: str) -> CachedModel | None:
        """The cached conversion of `source`, or None on a miss, a stale entry, or a damaged one (then removed)."""
        try:
            identity = _identity(source)
        except FileNotFoundError:
            return None
        entry = self.root / self.key(source, variant)
        try:
            manifest = json.loads((entry / MANIFEST).read_bytes())
        except FileNotFoundError:
            if entry.exists():
                return self._damaged(entry, FileNotFoundError(f"no {MANIFEST}"))
            return None
        except (OSError, ValueError) as exc:
            return self._damaged(entry, exc)
        if not _describes(manifest, identity, variant):
            return None
        try:
            model = _read_entry(entry, manifest)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
            return self._damaged(entry, exc)
        with contextlib.suppress(OSError):
            os.utime(entry)  # the directory's mtime orders entries for prune(); no file is rewritten
        return model

    def store(self, source: Path, variant: str, metadata: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Write an entry atomically: into a temporary directory, synced, then renamed into place."""
        identity = _identity(source)
        entry = self.root / self.key(source, variant)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{entry.name}-", dir=self.root))
        try:
            metadata_bytes = json.dumps(metadata).encode()
            _write_synced(tmp / METADATA, metadata_bytes)
            packed = _packed(tensors)
            save_file(packed, tmp / TENSORS)
            _fsync(tmp / TENSORS)
            manifest = {
                "format": FORMAT_VERSION,
                "source": identity,
                "variant": variant,
                "files": {
                    METADATA: {"size": len(metadata_bytes), "sha256": hashlib.sha256(metadata_bytes).hexdigest()},
                    TENSORS: {"size": (tmp / TENSORS).stat().st_size},
                },
                "tensors": list(packed),
            }
            _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync(tmp)
            self._publish(tmp, entry, identity, variant)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def prune(self, keep: int = 4) -> None:
        """Remove all but the `keep` most recently used entries, and leftovers of interrupted stores."""
        if not self.root.is_dir():
            return
        entries: list[tuple[float, Path]] = []
        for path in self.root.iterdir():
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:
                continue
            if path.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                if mtime < time.time() - _LEFTOVER_AGE_S:
                    shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir():
                entries.append((mtime, path))
        for _, path in sorted(entries, reverse=True)[keep:]:
            self._discard(path)

    def _publish(self, tmp: Path, entry: Path, identity: dict[str, Any], variant: str) -> None:
        # rename() of a directory fails on an existing non-empty one; then the entry is either what a concurrent
        # writer just stored for the same source (keep it) or stale/damaged (move it aside and try again).
        for _ in range(_PUBLISH_ATTEMPTS):
            try:
                tmp.rename(entry)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            else:
                _fsync(self.root)
                return
            try:
                if _describes(json.loads((entry / MANIFEST).read_bytes()), identity, variant):
                    return
            except (OSError, ValueError):
                pass
            self._discard(entry)
        raise OSError(f"could not store model cache entry {entry}: concurrent writers keep replacing it")

    def _damaged(self, entry: Path, exc: Exception) -> None:
        log.warning("model cache entry %s is damaged (%s); removing it", entry, exc)
        self._discard(entry)

    def _discard(self, entry: Path) -> None:
        # Renamed away first so that no reader ever sees a half-deleted entry.
        trash = self.root / f"{_TRASH_PREFIX}{uuid.uuid4().hex}"
        try:
            entry.rename(trash)
        except OSError:  # already gone, or not ours to remove (a read-only cache): leave it
            return
        shutil.rmtree(trash, ignore_errors=True)


def _identity(source: Path) -> dict[str, Any]:
    path = Path(source).resolve()
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _describes(manifest: Any, identity: dict[str, Any], variant: str) -> bool:
    return (
        isinstance(manifest, dict)
        and manifest.get("format") == FORMAT_VERSION
        and manifest.get("source") == identity
        and manifest.get("variant") == variant
    )


def _read_entry(entry: Path, manifest: dict[str, Any]) -> CachedModel:
    # Cheap checks only (sizes, the small metadata file's digest, the safetensors header); hashing the weights
    # would cost ~150 ms per 100 MB on every start.
    files = manifest["files"]
    for name, info in files.items():
        size = (entry / name).stat().st_size
        if size != info["size"]:
            raise _DamagedEntry(f"{name} has {size} bytes, expected {info['size']}")
    metadata_bytes = (entry / METADATA).read_bytes()
    if hashlib.sha256(metadata_bytes).hexdigest() != files[METADATA]["sha256"]:
        raise _DamagedEntry(f"{METADATA} does not match its checksum")
    with safe_open(entry / TENSORS, framework="pt") as weights:
        names = manifest["tensors"]
        if sorted(weights.keys()) != sorted(names):
            raise _DamagedEntry(f"{TENSORS} does not hold the tensors listed in {MANIFEST}")
        tensors = {name: weights.get_tensor(name) for name in names}
    return CachedModel(metadata=json.loads(metadata_bytes), tensors=tensors)


def _packed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors wants contiguous CPU tensors that do not share memory; copy only the ones that need it.
    packed: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        value = tensor.detach().cpu().contiguous()
        if value.untyped_storage().data_ptr() in storages:
            value = value.clone()
        if value.numel():
            storages.add(value.untyped_storage().data_ptr())
        packed[name] = value
    return packed


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("xb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _fsync(path: Path) -> None:
    if path.is_dir() and os.name != "posix":
        return  # directories cannot be opened for fsync on Windows
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
