"""A lock between processes that dies with its holder, waited for with a bound and the holder named.

It is `fcntl.flock` on an open file: the kernel releases it when the holder exits, however it exits (SIGKILL,
OOM, a reboot), so a lock is never left behind, unlike a lock that is a file's existence. The file holds a line
naming the holder, for the message of whoever waits.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)
POLL_S = 0.2


class LockTimeout(TimeoutError):
    """Another process held the lock for longer than the wait allowed; the message names it."""


@contextmanager
def process_lock(path: Path, purpose: str, wait_s: float) -> Iterator[None]:
    """Hold path's lock for the block, waiting at most wait_s for another holder (logged once, with who it is).

    purpose says what the holder does, for the log line and the error: "builds statelm's kernels in …".
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, purpose, wait_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, _describe_self().encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, path: Path, purpose: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        holder = _holder(path)
        if time.monotonic() >= deadline:
            raise LockTimeout(f"gave up after {wait_s:g}s waiting for {holder}, which {purpose} (lock {path})")
        if not waiting:
            log.info("waiting for %s, which %s (at most %gs; lock %s)", holder, purpose, wait_s, path)
            waiting = True
        time.sleep(POLL_S)


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return text or "another process"


def _describe_self() -> str:
    # the program's name only: its arguments may hold secrets (an --api-key) and the file is readable by others
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else Path(sys.executable).name
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return f"process {os.getpid()} on {socket.gethostname()} ({program}) since {started}\n"
