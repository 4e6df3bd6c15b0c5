"""Handing malloc's free memory back: a large block freed into the heap leaves the process's RSS."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Frees a 16 MiB block (glibc then keeps blocks up to that size in its heap), takes and frees 8 MiB, and prints
# how much of those 8 MiB the process still holds, after release_free_memory() where asked.
HELD_AFTER_FREE = """
import ctypes, sys
from statelm.host_allocator import release_free_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)

def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096

def touch_and_free(size: int) -> None:
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)

touch_and_free(16 << 20)
guard = libc.malloc(1024)  # keeps the freed block off the heap's top, which glibc trims by itself
before = rss()
touch_and_free(8 << 20)
guard2 = libc.malloc(1024)
if sys.argv[1] == "release":
    assert release_free_memory()
print(rss() - before)
"""


def held_after_free(mode: str) -> int:
    run = subprocess.run([sys.executable, "-c", HELD_AFTER_FREE, mode], capture_output=True, text=True, check=True)
    return int(run.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc")
def test_free_heap_memory_goes_back_to_the_system() -> None:
    assert held_after_free("keep") >= 4 << 20  # what release changes: glibc's heap kept the freed block
    assert held_after_free("release") < 1 << 20
