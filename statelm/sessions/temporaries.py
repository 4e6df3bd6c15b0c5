"""The temporaries of atomic writes in the state dir: names that say who writes them, and their cleanup at start.

A write goes to a hidden temporary (`.tmp-…`) renamed into place when complete; a directory it replaces is moved
aside (`.old-…`) until then. A crash leaves them behind. A server that has the state dir to itself removes every one
at start (and puts back a directory moved aside by a replacement that did not finish). Servers that share it (a
cluster's replicas) leave those of writers still running: a temporary's name carries its writer's process id and a
hash of its host, so one written by a process of this host that no longer runs is abandoned, and one of another
host (whose processes cannot be seen from here), or without a writer in its name, once older than
ABANDONED_AFTER_S, far longer than any write takes.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
import uuid
import zlib
from pathlib import Path

TEMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
ABANDONED_AFTER_S = 3600.0
HOST = f"{zlib.crc32(socket.gethostname().encode()):08x}"
_NAME = re.compile(r"(?P<name>.+?)(?:-(?P<pid>\d+)\.(?P<host>[0-9a-f]{8}))?-[0-9a-f]+")


def temporary_path(directory: Path, prefix: str, name: str) -> Path:
    """A fresh temporary in directory standing for name, that names this process as its writer."""
    return directory / f"{prefix}{name}-{os.getpid()}.{HOST}-{uuid.uuid4().hex}"


def clean_temporaries(root: Path, exclusive: bool = True) -> None:
    """Remove the temporaries a crash left in root and put back a directory moved aside by a replacement that did
    not finish: every one (exclusive: no other process writes there), else only those abandoned by their writer."""
    if not root.is_dir():
        return
    now = time.time()
    for entry in root.iterdir():
        prefix = next((p for p in (TEMP_PREFIX, OLD_PREFIX) if entry.name.startswith(p)), None)
        if prefix is None or not (exclusive or _abandoned(entry, prefix, now)):
            continue
        original = root / _original_name(entry, prefix)
        if prefix == OLD_PREFIX and not original.exists():
            entry.rename(original)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _original_name(entry: Path, prefix: str) -> str:
    rest = entry.name.removeprefix(prefix)
    match = _NAME.fullmatch(rest)
    return match["name"] if match else rest


def _abandoned(entry: Path, prefix: str, now: float) -> bool:
    """Whether no running process writes the temporary any more."""
    match = _NAME.fullmatch(entry.name.removeprefix(prefix))
    if match and match["host"] == HOST:
        return not _running(int(match["pid"]))
    try:
        return entry.lstat().st_mtime < now - ABANDONED_AFTER_S
    except FileNotFoundError:
        return False  # its writer finished meanwhile


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
