"""Run statelm's kernels on a given number of threads for a while (their pool's count, not torch's)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def kernel_threads(count: int) -> Iterator[None]:
    """statelm's kernels on `count` threads inside the block, then on as many as before."""
    previous = int(torch.ops.statelm.get_num_threads())
    torch.ops.statelm.set_num_threads(count)
    try:
        yield
    finally:
        torch.ops.statelm.set_num_threads(previous)
