"""What the host CPU can do: its model name, instruction-set flags and the compute dtype that suits it."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            break
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags as /proc/cpuinfo lists them."""
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_model() -> str:
    """The CPU's model name."""
    return _cpuinfo().get("model name", "unknown CPU")


def vector_flags() -> list[str]:
    """The flags that decide which kernels run (AVX2, FMA, AVX-512 family, AMX), sorted."""
    return sorted(flag for flag in cpu_flags() if flag.startswith(("avx", "amx", "fma", "f16c")))


def native_bf16() -> bool:
    """Whether the CPU computes bfloat16 in hardware (AVX512-BF16 or AMX) and torch uses those paths.

    ATEN_CPU_CAPABILITY can cap torch below the hardware; a capped torch emulates bf16 like an AVX2 CPU.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    return bool(cpu_flags() & NATIVE_BF16_FLAGS) and capability.startswith("AVX512")


def describe() -> str:
    """One line: model, torch's vector capability and the relevant flags."""
    return f"{cpu_model()} (torch {torch.backends.cpu.get_cpu_capability()}; {' '.join(vector_flags())})"
