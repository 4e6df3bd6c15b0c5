"""How this process's C allocator gives freed memory back: large blocks in their own mappings, unmapped when freed."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
# Blocks this size and larger get their own mapping: a prompt's activations (128 tokens x 8192 float32 values and
# up) go back to the system when freed; a decode step's tensors (a few rows) stay below it and reuse the heap.
LARGE_BLOCK_BYTES = 4 << 20


@functools.cache
def return_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Have malloc serve blocks of `threshold` bytes and more from their own mappings, for good: glibc's default
    raises that threshold to the largest block freed so far, after which a long prompt's activations stay in the
    heap when freed (hundreds of MiB of RSS on a 1B model). False where the C library has no mallopt."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
