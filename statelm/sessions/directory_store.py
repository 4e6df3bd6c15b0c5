"""The state store in a directory: the layout a single server, and a cluster's replicas sharing it, keep.

```
<root>/sessions/<id>/           a session saved or spilled (a bundle in the snapshot format)
<root>/journal/<id>.journal     a session's journal (a log)
<root>/snapshots/<id>/          a user's snapshot (a bundle in the snapshot format)
<root>/.spill-<pid>/            the private store of a server keeping nothing (sessions/<id>/ in it), removed at close
```

A bundle is written into a hidden temporary directory beside it (`.tmp-…`), each file and then the directory fsynced,
and renamed into place; a bundle it replaces is moved aside (`.old-…`) first and removed after. A file replaced in a
bundle and a log replaced whole are written to a temporary file, fsynced and renamed over the old one; an append is
one write and an fsync. The directory is fsynced after an entry in it is made, renamed or removed. Temporaries name
their writer (statelm.sessions.temporaries), so that `prepare` tells those of running writers from those a crash left.
A write that fails (a full disk) removes its temporary at once, and an append that fails cuts the log back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from statelm.sessions.state_store import Area
from statelm.sessions.storage import FULL_BELOW_BYTES, StorageCondition, StoreSpace
from statelm.sessions.synced_files import fsync_directory, write_synced
from statelm.sessions.temporaries import OLD_PREFIX, TEMP_PREFIX, clean_temporaries, temporary_path

LOG_SUFFIX = ".journal"


class DirectoryStore:
    """The state store (statelm.sessions.state_store) in directory root; nothing is made there before it is needed."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __repr__(self) -> str:
        return f"DirectoryStore({str(self.root)!r})"

    def prepare(self, area: Area, exclusive: bool) -> None:
        """Make the area's directory and remove the temporaries a crash left in it (see clean_temporaries)."""
        directory = self.root / area
        directory.mkdir(parents=True, exist_ok=True)
        clean_temporaries(directory, exclusive)

    def write_bundle(self, area: Area, name: str, files: Mapping[str, bytes]) -> None:
        """Write the files into a temporary directory and rename it into place."""
        target = self._bundle(area, name)
        temporary = temporary_path(target.parent, TEMP_PREFIX, name)
        temporary.mkdir(parents=True)
        try:
            for file, data in files.items():
                write_synced(temporary / file, data)
            fsync_directory(temporary)
            _replace_directory(temporary, target)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)

    def read_file(self, area: Area, name: str, file: str) -> bytes:
        """One file of a bundle's directory."""
        return (self._bundle(area, name) / file).read_bytes()

    def replace_file(self, area: Area, name: str, file: str, data: bytes) -> None:
        """Write a temporary file in the bundle's directory and rename it over the file."""
        directory = self._bundle(area, name)
        _replace_file(temporary_path(directory, TEMP_PREFIX, file), directory / file, data)

    def delete_bundle(self, area: Area, name: str) -> None:
        """Remove a bundle's directory."""
        shutil.rmtree(self._bundle(area, name))

    def bundle_exists(self, area: Area, name: str) -> bool:
        """Whether the bundle's directory exists."""
        return self._bundle(area, name).is_dir()

    def bundle_names(self, area: Area) -> list[str]:
        """The visible directories of the area (temporaries are hidden)."""
        return sorted(entry.name for entry in _visible(self.root / area) if entry.is_dir())

    def bundle_size(self, area: Area, name: str) -> int:
        """Bytes of the files in a bundle's directory."""
        return sum(entry.stat().st_size for entry in self._bundle(area, name).iterdir() if entry.is_file())

    def append_log(self, name: str, data: bytes) -> int:
        """Append with one write and fsync it (and the directory, if the file is new)."""
        path = self._log(name)
        created = not path.exists()
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            before = os.fstat(descriptor).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(descriptor, view) :]
                os.fsync(descriptor)
            except OSError:
                with contextlib.suppress(OSError):  # what a full disk took of the record goes
                    os.ftruncate(descriptor, before)
                raise
            size = os.fstat(descriptor).st_size
        finally:
            os.close(descriptor)
        if created:
            fsync_directory(path.parent)
        return size

    def replace_log(self, name: str, data: bytes) -> int:
        """Write a temporary file, fsync it and rename it over the log."""
        path = self._log(name)
        _replace_file(temporary_path(path.parent, TEMP_PREFIX, path.name), path, data)
        return len(data)

    def read_log(self, name: str) -> bytes:
        """A log file's bytes."""
        return self._log(name).read_bytes()

    def truncate_log(self, name: str, size: int) -> None:
        """Truncate the log file and fsync it."""
        with self._log(name).open("r+b") as file:
            file.truncate(size)
            file.flush()
            os.fsync(file.fileno())

    def remove_log(self, name: str) -> None:
        """Unlink the log file and fsync the directory."""
        path = self._log(name)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_directory(path.parent)

    def log_exists(self, name: str) -> bool:
        """Whether the log file exists."""
        return self._log(name).is_file()

    def log_size(self, name: str) -> int:
        """Bytes of the log file."""
        return self._log(name).stat().st_size

    def log_names(self) -> list[str]:
        """The names of the visible `.journal` files."""
        entries = _visible(self.root / Area.JOURNAL)
        return sorted(entry.name.removesuffix(LOG_SUFFIX) for entry in entries if entry.name.endswith(LOG_SUFFIX))

    def space(self) -> StoreSpace:
        """The directory's file system as statvfs sees it: read-only, under FULL_BELOW_BYTES free, or ok."""
        location = f"the state directory {self.root}"
        try:
            stats = os.statvfs(self.root)
        except FileNotFoundError:
            return StoreSpace(location, StorageCondition.MISSING)
        free, total = stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize
        if not self.root.is_dir():
            condition = StorageCondition.MISSING
        elif stats.f_flag & os.ST_RDONLY:
            condition = StorageCondition.READ_ONLY
        else:
            condition = StorageCondition.FULL if free < FULL_BELOW_BYTES else StorageCondition.OK
        return StoreSpace(location, condition, free, total)

    def private(self) -> DirectoryStore:
        """A store in `.spill-<pid>` under root."""
        return DirectoryStore(self.root / f".spill-{os.getpid()}")

    def destroy(self) -> None:
        """Remove root and everything in it."""
        shutil.rmtree(self.root, ignore_errors=True)

    def _bundle(self, area: Area, name: str) -> Path:
        return self.root / area / name

    def _log(self, name: str) -> Path:
        return self.root / Area.JOURNAL / f"{name}{LOG_SUFFIX}"


def _visible(directory: Path) -> list[Path]:
    """The entries of directory that are not hidden (none if it does not exist)."""
    if not directory.is_dir():
        return []
    return [entry for entry in directory.iterdir() if not entry.name.startswith(".")]


def _replace_file(temporary: Path, target: Path, data: bytes) -> None:
    """Write data to temporary, fsynced, and rename it over target; a write that fails removes its temporary."""
    try:
        write_synced(temporary, data)
        os.replace(temporary, target)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)


def _replace_directory(source: Path, target: Path) -> None:
    """Rename source to target; an existing target is moved aside first and removed after."""
    if not target.exists():
        source.rename(target)
    else:
        old = temporary_path(target.parent, OLD_PREFIX, target.name)
        target.rename(old)
        source.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    fsync_directory(target.parent)
