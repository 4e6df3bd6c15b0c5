"""Temporaries in a shared state dir: a server that shares it removes only those whose writer is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from statelm.sessions.temporaries import (
    ABANDONED_AFTER_S,
    HOST,
    OLD_PREFIX,
    TEMP_PREFIX,
    clean_temporaries,
    temporary_path,
)


def dead_pid() -> int:
    """The id of a process that has exited."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_temporary_names_its_writer() -> None:
    path = temporary_path(Path("/state"), TEMP_PREFIX, "sess-a-b")
    assert path.name.startswith(f".tmp-sess-a-b-{os.getpid()}.{HOST}-")


def test_sharing_servers_leave_live_writers_temporaries_and_remove_abandoned_ones(tmp_path: Path) -> None:
    live = temporary_path(tmp_path, TEMP_PREFIX, "sess-live")  # this process writes it
    live.mkdir()
    dead = tmp_path / f".tmp-sess-dead-{dead_pid()}.{HOST}-0123abcd"
    dead.mkdir()
    elsewhere = tmp_path / ".tmp-x.journal-42.0badf00d-0123abcd"  # another host's writer: unknowable from here
    elsewhere.write_bytes(b"half")
    stale = tmp_path / ".tmp-y.journal-43.0badf00d-0123abcd"
    stale.write_bytes(b"half")
    old = time.time() - ABANDONED_AFTER_S - 1
    os.utime(stale, (old, old))
    clean_temporaries(tmp_path, exclusive=False)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == sorted([live.name, elsewhere.name])
    clean_temporaries(tmp_path)  # a server with the state dir to itself removes all
    assert list(tmp_path.iterdir()) == []


def test_a_directory_a_dead_writer_moved_aside_is_put_back(tmp_path: Path) -> None:
    aside = tmp_path / f"{OLD_PREFIX}sess-a-b-{dead_pid()}.{HOST}-0123abcd"
    aside.mkdir()
    writing = temporary_path(tmp_path, OLD_PREFIX, "sess-c")  # a replacement still running here
    writing.mkdir()
    clean_temporaries(tmp_path, exclusive=False)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == sorted(["sess-a-b", writing.name])
