"""The host memory a server may use, what its models take of it, and the start-up check of one against the other."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from statelm.kernels.quant import PackedWeight

CGROUP = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")


class MemoryBudgetError(ValueError):
    """The models a server was asked to hold need more memory than it may use."""


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


def module_bytes(module: nn.Module) -> int:
    """Bytes a model's weights take: its parameters, buffers and packed quantized weights, shared storage once."""
    storages: dict[int, int] = {}
    for part in module.modules():
        tensors = [*part.parameters(recurse=False), *part.buffers(recurse=False)]
        for value in vars(part).values():
            if isinstance(value, PackedWeight):
                tensors.extend(part.data for part in value.parts)
                tensors.extend(part.interleaved for part in value.parts if part.interleaved is not None)
            elif isinstance(value, torch.Tensor):  # a dequantized copy kept beside a packed weight
                tensors.append(value)
        for tensor in tensors:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def check_memory(available: int, needs: list[tuple[str, int]]) -> None:
    """Raise MemoryBudgetError naming every need when together they are more than available."""
    total = sum(size for _, size in needs)
    if total <= available:
        return
    parts = ", ".join(f"{what} {_mib(size)}" for what, size in needs)
    raise MemoryBudgetError(
        f"not enough memory: {parts} need {_mib(total)} together, but this server may use {_mib(available)} "
        "(the memory available when it started); lower --kv-cache-memory or serve fewer or smaller models"
    )


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"
