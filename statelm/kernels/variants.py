"""The CPU classes statelm's kernels are compiled for, one library each, and the choice of one for this CPU.

A class is here only where the kernels have a code path for it (their `#if defined(__AVX2__)`… branches): the
scalar x86-64-v2 baseline, AVX2+FMA+F16C, AVX-512 (F, BW, DQ, VL) and AVX-512 with VNNI (the int8 and int16 dot
products of gguf_matmul_int.cpp and gguf_tiles.cpp). A kernel that gains a path for another feature
(`__AVX512BF16__`, say) adds a class here.

This module is read by setup.py before the package is installed: standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# What x86-64-v2 needs (/proc/cpuinfo names); every later class needs these too.
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
# What the compiler may emit for plain code under -march=haswell (x86-64-v3): vector, FMA and bit-manipulation.
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Variant:
    """One CPU class: its name, the -march it is compiled with and the CPU flags it needs."""

    name: str
    march: str  # the value of -march
    cpu_flags: frozenset[str]

    @property
    def library_stem(self) -> str:
        """The shared library's file name without its platform suffix."""
        return f"statelm_kernels_{self.name.replace('-', '_')}"


# Lowest first: the best class a CPU supports is the last one whose flags it has.
VARIANTS = (
    Variant("x86-64-v2", "x86-64-v2", _V2),
    Variant("avx2", "haswell", _V3),
    Variant("avx512", "skylake-avx512", _V4),
    Variant("avx512-vnni", "cascadelake", _V4 | {"avx512_vnni"}),  # cascadelake: skylake-avx512 + VNNI
)
# ATEN_CPU_CAPABILITY (torch's class names) caps the choice at the class torch's own kernels of that name need.
CAPPED_AT = {"default": "x86-64-v2", "avx2": "avx2", "avx512": "avx512"}


def select_variant(cpu_flags: Iterable[str], capability: str | None = None) -> Variant | None:
    """The best class this CPU runs, capped at an ATEN_CPU_CAPABILITY value; None if it runs none of them.

    A cap of `avx512` means torch's AVX-512 class (F, BW, DQ, VL): the VNNI class stays above it, so that one
    setting shows on a VNNI machine what an AVX-512 CPU without VNNI computes.
    """
    flags = frozenset(cpu_flags)
    names = [variant.name for variant in VARIANTS]
    limit = CAPPED_AT.get((capability or "").lower())
    allowed = VARIANTS[: names.index(limit) + 1] if limit else VARIANTS
    candidates = [variant for variant in allowed if variant.cpu_flags <= flags]
    return candidates[-1] if candidates else None


def by_name(name: str) -> Variant:
    """The class of that name."""
    for variant in VARIANTS:
        if variant.name == name:
            return variant
    raise KeyError(f"no CPU class {name!r}; known: {', '.join(v.name for v in VARIANTS)}")
