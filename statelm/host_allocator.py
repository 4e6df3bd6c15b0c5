"""Handing the memory this process's C allocator holds free back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim.argtypes = (ctypes.c_size_t,)
    return trim


def release_free_memory() -> bool:
    """Give the pages malloc holds free (a long prompt's activations, once freed) back to the system, in every
    arena; False where the C library (not glibc) has no malloc_trim. A few milliseconds: for idle moments."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
