"""A bounded disk cache of converted models: JSON metadata plus memory-mapped safetensors weights.

An entry is keyed by the source file's content (an xxh3-128 hash, remembered per path, size, mtime and inode so
that a start hashes a file once) and the conversion's variant, so copies of one model share an entry and a
changed file is a miss; an entry made from the first bytes of a file only (a GGUF's header) is keyed by those.
Entries are written atomically (a temporary directory, synced, renamed into place), and past the size cap the
least recently used go first. Removing an entry another process has mapped is safe: its files stay readable
until it unmaps them.
"""

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
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from statelm.paths import APP_NAME

# Bump when the layout of an entry changes; entries of another version are misses and get replaced.
FORMAT_VERSION = 2  # 2: keyed by the source's content
CACHE_DIR_ENV = "STATELM_CACHE_DIR"
DEFAULT_MAX_BYTES = 8 * 2**30
MANIFEST = "manifest.json"
METADATA = "metadata.json"
TENSORS = "tensors.safetensors"
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_SOURCES = ".sources"  # per source path: the content hash of the file as it was (size, mtime, inode)
_HASH_CHUNK = 16 << 20
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


@dataclass(frozen=True)
class CacheEntry:
    """One entry as `statelm cache ls` shows it: its key, bytes on disk, last use and what it was made from."""

    key: str
    path: Path
    size: int
    last_used: float  # seconds since the epoch
    source: str  # the path of the file it was first made from
    variant: str


def default_cache_root() -> Path:
    """`$STATELM_CACHE_DIR/models` when that is set, else `models` in the per-user cache directory."""
    base = os.environ.get(CACHE_DIR_ENV)
    return (Path(base).expanduser() if base else Path(platformdirs.user_cache_dir(APP_NAME))) / "models"


class ModelCache:
    """Converted models on disk, one directory per (source content, variant), at most max_bytes in all."""

    def __init__(self, root: Path | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root) if root is not None else default_cache_root()
        self.max_bytes = max_bytes  # None: no cap

    def key(self, source: Path, variant: str, hashed_bytes: int | None = None) -> str:
        """The entry name of a source file and variant: a hex digest of the file's content hash and the variant."""
        return _entry_name(self.content_hash(source, hashed_bytes), variant)

    def content_hash(self, source: Path, hashed_bytes: int | None = None) -> str:
        """The xxh3-128 of the file's bytes (its first hashed_bytes only, when given), hashed once per path, size,
        mtime and inode (then remembered)."""
        path = Path(source).resolve()
        status = path.stat()
        stamp = [str(path), status.st_size, status.st_mtime_ns, status.st_ino, status.st_dev]
        named = json.dumps([str(path), hashed_bytes]).encode()
        memo = self.root / _SOURCES / f"{hashlib.sha256(named).hexdigest()[:32]}.json"
        try:
            remembered = json.loads(memo.read_bytes())
            if remembered["stamp"] == stamp:
                return str(remembered["hash"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        remaining = status.st_size if hashed_bytes is None else min(hashed_bytes, status.st_size)
        digest = xxhash.xxh3_128()
        with path.open("rb") as file:
            while remaining and (chunk := file.read(min(_HASH_CHUNK, remaining))):
                digest.update(chunk)
                remaining -= len(chunk)
        content = digest.hexdigest()
        with contextlib.suppress(OSError):  # a read-only cache hashes again next time
            memo.parent.mkdir(parents=True, exist_ok=True)
            _replace_atomically(memo, json.dumps({"stamp": stamp, "hash": content}).encode())
        return content

    def load(self, source: Path, variant: str, hashed_bytes: int | None = None) -> CachedModel | None:
        """The cached conversion of `source` (made from its first hashed_bytes only, when given), or None on a miss,
        a stale entry, or a damaged one (then removed)."""
        try:
            content = self.content_hash(source, hashed_bytes)
        except FileNotFoundError:
            return None
        entry = self.root / _entry_name(content, variant)
        existed = entry.exists()  # before the read: a writer may publish the entry (a rename) during it
        try:
            manifest = json.loads((entry / MANIFEST).read_bytes())
        except FileNotFoundError:
            if existed and entry.exists():
                return self._damaged(entry, FileNotFoundError(f"no {MANIFEST}"))
            return None
        except (OSError, ValueError) as exc:
            return self._damaged(entry, exc)
        if not _describes(manifest, content, variant):
            return None
        try:
            model = _read_entry(entry, manifest)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
            return self._damaged(entry, exc)
        with contextlib.suppress(OSError):
            os.utime(entry)  # the directory's mtime is the entry's last use, for eviction; no file is rewritten
        return model

    def store(
        self,
        source: Path,
        variant: str,
        metadata: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        hashed_bytes: int | None = None,
    ) -> None:
        """Write an entry atomically (into a temporary directory, synced, then renamed into place), then evict the
        least recently used others past the cap; an entry larger than the cap alone is not kept. hashed_bytes: the
        entry is made from the source's first bytes only, and keyed by them."""
        content = self.content_hash(source, hashed_bytes)
        entry = self.root / _entry_name(content, variant)
        metadata_bytes = json.dumps(metadata).encode()
        packed = _packed(tensors)
        size = len(metadata_bytes) + sum(tensor.nbytes for tensor in packed.values())
        if self.max_bytes is not None and size > self.max_bytes:
            log.warning(
                "not caching %s: its %.1f GiB exceed the model cache's cap of %.1f GiB (--model-cache-size)",
                Path(source).name,
                size / 2**30,
                self.max_bytes / 2**30,
            )
            return
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{entry.name}-", dir=self.root))
        try:
            _write_synced(tmp / METADATA, metadata_bytes)
            save_file(packed, tmp / TENSORS)
            _fsync(tmp / TENSORS)
            manifest = {
                "format": FORMAT_VERSION,
                "source": {"hash": content, "path": str(Path(source).resolve())},
                "variant": variant,
                "files": {
                    METADATA: {"size": len(metadata_bytes), "sha256": hashlib.sha256(metadata_bytes).hexdigest()},
                    TENSORS: {"size": (tmp / TENSORS).stat().st_size},
                },
                "tensors": list(packed),
            }
            _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            _fsync(tmp)
            self._publish(tmp, entry, content, variant)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.prune(keep=entry.name)

    def entries(self) -> list[CacheEntry]:
        """Every entry, most recently used first (entries being written or removed are not listed)."""
        found: list[CacheEntry] = []
        if not self.root.is_dir():
            return found
        for path in self.root.iterdir():
            if path.name.startswith("."):
                continue
            try:
                last_used = path.stat().st_mtime
                size = sum(file.stat().st_size for file in path.iterdir())
            except OSError:  # removed meanwhile, or not a directory
                continue
            try:
                manifest = json.loads((path / MANIFEST).read_bytes())
                source, variant = str(manifest["source"]["path"]), str(manifest["variant"])
            except (OSError, ValueError, KeyError, TypeError):
                source, variant = "?", "?"
            found.append(CacheEntry(path.name, path, size, last_used, source, variant))
        return sorted(found, key=lambda entry: entry.last_used, reverse=True)

    def remove(self, key: str) -> bool:
        """Remove one entry (a server that has it mapped keeps reading it); False if there was none."""
        entry = self.root / key
        if key.startswith(".") or "/" in key or not entry.is_dir():
            return False
        return self._discard(entry)

    def clear(self) -> int:
        """Remove every entry and what the cache remembers of source files; returns the entries removed."""
        removed = sum(self.remove(entry.key) for entry in self.entries())
        shutil.rmtree(self.root / _SOURCES, ignore_errors=True)
        return removed

    def prune(self, keep: str | None = None) -> None:
        """Evict the least recently used entries past the cap (never `keep`), and leftovers of interrupted stores."""
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            if path.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                with contextlib.suppress(FileNotFoundError):
                    if path.stat().st_mtime < time.time() - _LEFTOVER_AGE_S:
                        shutil.rmtree(path, ignore_errors=True)
        if self.max_bytes is None:
            return
        total = 0
        for entry in self.entries():
            total += entry.size
            if total > self.max_bytes and entry.key != keep and self._discard(entry.path):
                log.info("model cache: evicted %s (%s, %.1f MiB), least recently used", entry.key, entry.source,
                         entry.size / 2**20)  # fmt: skip
                total -= entry.size

    def _publish(self, tmp: Path, entry: Path, content: str, variant: str) -> None:
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
                if _describes(json.loads((entry / MANIFEST).read_bytes()), content, variant):
                    return
            except (OSError, ValueError):
                pass
            self._discard(entry)
        raise OSError(f"could not store model cache entry {entry}: concurrent writers keep replacing it")

    def _damaged(self, entry: Path, exc: Exception) -> None:
        log.warning("model cache entry %s is damaged (%s); removing it", entry, exc)
        self._discard(entry)

    def _discard(self, entry: Path) -> bool:
        # Renamed away first so that no reader ever sees a half-deleted entry.
        trash = self.root / f"{_TRASH_PREFIX}{uuid.uuid4().hex}"
        try:
            entry.rename(trash)
        except OSError:  # already gone, or not ours to remove (a read-only cache): leave it
            return False
        shutil.rmtree(trash, ignore_errors=True)
        return True


def _entry_name(content: str, variant: str) -> str:
    return hashlib.sha256(json.dumps([content, variant]).encode()).hexdigest()[:32]


def _describes(manifest: Any, content: str, variant: str) -> bool:
    return (
        isinstance(manifest, dict)
        and manifest.get("format") == FORMAT_VERSION
        and isinstance(manifest.get("source"), dict)
        and manifest["source"].get("hash") == content
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


def _replace_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}-{uuid.uuid4().hex}")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


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
