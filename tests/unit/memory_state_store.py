"""A state store in memory, as an object store would hold it: whole objects put, got, listed and deleted, no renames.

A bundle is a dict of files swapped in whole; a log is a list of appended chunks (one object per append on an object
store), read back joined. Test code: it shows the sessions layer works on the protocol alone, touching no path.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Mapping

from statelm.sessions.state_store import Area
from statelm.sessions.storage import StorageCondition, StoreSpace


class MemoryStore:
    """The state store protocol (statelm.sessions.state_store) over dicts, safe to use from several threads."""

    def __init__(self) -> None:
        self.bundles: dict[tuple[Area, str], dict[str, bytes]] = {}
        self.logs: dict[str, list[bytes]] = {}
        self._lock = threading.Lock()

    def prepare(self, area: Area, exclusive: bool) -> None:
        """Nothing to do: every write here replaces a whole entry, so none is ever left half done."""

    def write_bundle(self, area: Area, name: str, files: Mapping[str, bytes]) -> None:
        """Swap in a new dict of files."""
        with self._lock:
            self.bundles[area, name] = dict(files)

    def read_file(self, area: Area, name: str, file: str) -> bytes:
        """One file of a bundle."""
        with self._lock:
            files = self._bundle(area, name)
            if file not in files:
                raise _missing(f"{area}/{name}/{file}")
            return files[file]

    def replace_file(self, area: Area, name: str, file: str, data: bytes) -> None:
        """Swap in the bundle's dict with one file replaced."""
        with self._lock:
            self.bundles[area, name] = {**self._bundle(area, name), file: bytes(data)}

    def delete_bundle(self, area: Area, name: str) -> None:
        """Drop a bundle."""
        with self._lock:
            self._bundle(area, name)
            del self.bundles[area, name]

    def bundle_exists(self, area: Area, name: str) -> bool:
        """Whether the bundle is held."""
        with self._lock:
            return (area, name) in self.bundles

    def bundle_names(self, area: Area) -> list[str]:
        """The area's bundle names, sorted."""
        with self._lock:
            return sorted(name for held_area, name in self.bundles if held_area == area)

    def bundle_size(self, area: Area, name: str) -> int:
        """Bytes of a bundle's files."""
        with self._lock:
            return sum(map(len, self._bundle(area, name).values()))

    def append_log(self, name: str, data: bytes) -> int:
        """Add a chunk to the log."""
        with self._lock:
            chunks = self.logs.setdefault(name, [])
            chunks.append(bytes(data))
            return sum(map(len, chunks))

    def replace_log(self, name: str, data: bytes) -> int:
        """Make data the log's only chunk."""
        with self._lock:
            self.logs[name] = [bytes(data)]
            return len(data)

    def read_log(self, name: str) -> bytes:
        """The log's chunks joined."""
        with self._lock:
            return b"".join(self._log(name))

    def truncate_log(self, name: str, size: int) -> None:
        """Keep the chunks within size, the one across it cut."""
        with self._lock:
            kept, total = [], 0
            for chunk in self._log(name):
                if total >= size:
                    break
                kept.append(chunk[: size - total])
                total += len(kept[-1])
            self.logs[name] = kept

    def remove_log(self, name: str) -> None:
        """Drop the log, if there is one."""
        with self._lock:
            self.logs.pop(name, None)

    def log_exists(self, name: str) -> bool:
        """Whether the log is held."""
        with self._lock:
            return name in self.logs

    def log_size(self, name: str) -> int:
        """Bytes of the log."""
        with self._lock:
            return sum(map(len, self._log(name)))

    def log_names(self) -> list[str]:
        """The log names, sorted."""
        with self._lock:
            return sorted(self.logs)

    def space(self) -> StoreSpace:
        """Always there and writable; its room is the process's memory, which it cannot tell."""
        return StoreSpace("the state store in memory", StorageCondition.OK)

    def private(self) -> MemoryStore:
        """Another, empty store."""
        return MemoryStore()

    def destroy(self) -> None:
        """Drop everything."""
        with self._lock:
            self.bundles.clear()
            self.logs.clear()

    def _bundle(self, area: Area, name: str) -> dict[str, bytes]:
        if (area, name) not in self.bundles:
            raise _missing(f"{area}/{name}")
        return self.bundles[area, name]

    def _log(self, name: str) -> list[bytes]:
        if name not in self.logs:
            raise _missing(f"log {name}")
        return self.logs[name]


def _missing(what: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), what)
