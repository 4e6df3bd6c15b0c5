"""What interleaving a block matrix read from a mapped file does with the file's pages: they leave the process (the
weights count once in its resident memory), and where the rows are still read in place (a tied embedding's
lookups) they stay in the page cache, so that a lookup is a minor fault, not a read from the disk."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from statelm.kernels.build import kernels_available
from statelm.kernels.quant import BlockMatrix

pytestmark = pytest.mark.skipif(not kernels_available(), reason="interleaving needs statelm's kernels")
LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
ROWS, IN_FEATURES = 1024, 1024  # Q8_0: 32 blocks of 34 bytes a row, 1,088 KiB in all


def mapped_matrix(path: Path, read_in_place: bool) -> tuple[mmap.mmap, BlockMatrix]:
    """A Q8_0 matrix viewing a file mapped as the loader maps GGUFs (private), every page read once."""
    path.write_bytes(np.random.default_rng(0).integers(0, 256, ROWS * IN_FEATURES // 32 * 34, dtype=np.uint8))
    with path.open("rb") as file:
        os.fsync(file.fileno())  # clean pages, which the OS may drop
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    data = torch.frombuffer(mapping, dtype=torch.uint8)
    assert int(data.sum()) > 0  # every page read, so mapped into this process
    matrix = BlockMatrix.of(Q.Q8_0, data, (ROWS, IN_FEATURES), mapped=True)
    return mapping, BlockMatrix(**{**matrix.__dict__, "read_in_place": read_in_place})


def pages(matrix: BlockMatrix) -> tuple[int, int]:
    """(pages of the matrix mapped into this process, pages of it in the page cache)."""
    start, length = matrix.data.data_ptr(), matrix.data.numel()
    vector = (ctypes.c_ubyte * -(-length // mmap.PAGESIZE))()
    assert LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) == 0, ctypes.get_errno()
    cached = sum(byte & 1 for byte in vector)
    mapped_kib = 0
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            if "-" in line.split(" ", 1)[0]:
                low, high = (int(bound, 16) for bound in line.split(" ", 1)[0].split("-"))
                inside = low <= start < high
            elif inside and line.startswith("Rss:"):
                mapped_kib = int(line.split()[1])
    return mapped_kib * 1024 // mmap.PAGESIZE, cached


@pytest.mark.parametrize("read_in_place", [False, True])
def test_interleaving_hands_the_file_pages_back_and_keeps_them_cached_where_rows_are_read(
    tmp_path: Path, read_in_place: bool
) -> None:
    mapping, matrix = mapped_matrix(tmp_path / "blocks.bin", read_in_place)
    before = pages(matrix)
    assert before[0] > 0 and before[1] > 0
    interleaved = matrix.interleave()
    assert interleaved.interleaved is not None and interleaved.read_in_place == read_in_place
    mapped, cached = pages(matrix)
    assert mapped == 0  # the copy alone counts in resident memory
    if read_in_place:
        assert cached == before[1]  # a row looked up again comes from the page cache
    row = torch.ops.statelm.gguf_dequantize(matrix.data, int(Q.Q8_0), torch.tensor([ROWS - 1]))
    assert torch.equal(row, torch.ops.statelm.gguf_dequantize(interleaved.data, int(Q.Q8_0), torch.tensor([ROWS - 1])))
    del matrix, interleaved, row
    mapping.close()
