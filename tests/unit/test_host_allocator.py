"""The allocator policy: a large block freed goes back to the system, however large the blocks freed before it."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Frees a 16 MiB block (glibc would then keep blocks up to that size in its heap), takes and frees 8 MiB twice,
# and prints how much of those 8 MiB the process still holds.
HELD_AFTER_FREE = """
import ctypes, sys
from statelm.host_allocator import return_large_blocks
if sys.argv[1] == "policy":
    assert return_large_blocks()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)

def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096

def touch_and_free(size: int) -> None:
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)

touch_and_free(16 << 20)
before = rss()
touch_and_free(8 << 20)
touch_and_free(8 << 20)
print(rss() - before)
"""


def held_after_free(mode: str) -> int:
    run = subprocess.run([sys.executable, "-c", HELD_AFTER_FREE, mode], capture_output=True, text=True, check=True)
    return int(run.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc")
def test_large_blocks_go_back_to_the_system_when_freed() -> None:
    assert held_after_free("policy") < 1 << 20
    assert held_after_free("default") >= 4 << 20  # what the policy changes: glibc's heap kept the block
