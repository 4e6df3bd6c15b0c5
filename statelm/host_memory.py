"""How much memory this process may still take: the kernel's available-memory estimate, capped by its control group."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")


def available_host_memory() -> int:
    """Bytes this process may still take: the kernel's estimate of available memory (free plus reclaimable), capped
    by what the process's control group leaves of its limit."""
    available = _meminfo_available()
    limit = _cgroup_headroom()
    return available if limit is None else min(available, limit)


def _meminfo_available() -> int:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_headroom() -> int | None:
    """What the memory limits of the process's control group and its parents leave (cgroup v2 or v1), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    headroom: list[int] = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if not controllers:  # v2: one tree
            headroom += _limits_left(CGROUP, group, "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            headroom += _limits_left(CGROUP / "memory", group, "memory.limit_in_bytes", "memory.usage_in_bytes")
    return min(headroom, default=None)


def _limits_left(root: Path, group: str, limit_file: str, usage_file: str) -> list[int]:
    """Limit less usage of every group from group up to root that sets a limit ("max" or a huge number: none)."""
    left = []
    directory = root / group.lstrip("/")
    for folder in (directory, *directory.parents):
        try:
            limit, usage = ((folder / name).read_text().strip() for name in (limit_file, usage_file))
        except OSError:
            pass
        else:
            if limit.isdigit() and int(limit) < 1 << 60:
                left.append(max(0, int(limit) - int(usage)))
        if folder == root:
            break
    return left
