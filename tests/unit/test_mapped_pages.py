"""What interleaving a block matrix read from a mapped file does with the file's pages: they leave the process (the
weights count once in its resident memory), and an embedding tied to the matrix looks its rows up in the copy, so
that they never come back (read back from the file, each new token's page was a read from the disk)."""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from statelm.kernels.build import kernels_available
from statelm.kernels.quant import BlockMatrix, PackedWeight
from statelm.models.layers import RowChunking
from statelm.models.packed import PackedEmbedding, PackedLinear

pytestmark = pytest.mark.skipif(not kernels_available(), reason="interleaving needs statelm's kernels")
ROWS, IN_FEATURES = 1024, 1024  # Q8_0: 32 blocks of 34 bytes a row, 1,088 KiB in all


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN for NaN (random bytes make some blocks' scales NaN)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def mapped_weight(path: Path, rows: int = ROWS) -> tuple[mmap.mmap, PackedWeight]:
    """A Q8_0 matrix viewing a file mapped as the loader maps GGUFs (private), every page read once."""
    path.write_bytes(np.random.default_rng(0).integers(0, 256, rows * IN_FEATURES // 32 * 34, dtype=np.uint8))
    with path.open("rb") as file:
        os.fsync(file.fileno())  # clean pages, which the OS may take back
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    data = torch.frombuffer(mapping, dtype=torch.uint8)
    assert int(data.sum()) > 0  # every page read, so mapped into this process
    return mapping, PackedWeight([BlockMatrix.of(Q.Q8_0, data, (rows, IN_FEATURES), mapped=True)])


def peak_kib() -> int:
    """The process's peak resident memory since it was last reset (VmHWM)."""
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def mapped_pages(tensor: torch.Tensor) -> int:
    """Pages of the mapping holding tensor that are mapped into this process (its Rss in /proc/self/smaps)."""
    start, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            field = line.split(" ", 1)[0]
            if "-" in field:
                low, high = (int(bound, 16) for bound in field.split("-"))
                inside = low <= start < high
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024 // mmap.PAGESIZE
    raise AssertionError("no mapping holds the tensor")


def test_a_tied_embedding_looks_rows_up_in_the_head_s_copy_and_the_file_pages_stay_out(tmp_path: Path) -> None:
    mapping, weight = mapped_weight(tmp_path / "blocks.bin")
    file_rows = weight.parts[0].data
    expected = weight.embedding(torch.arange(ROWS))
    assert mapped_pages(file_rows) > 0
    head = PackedLinear(weight, None, RowChunking())
    embedding = PackedEmbedding(weight, tied_head=head)
    assert embedding.weight is head.weight and head not in list(embedding.modules())
    head.use(kernel=True)  # interleaves the head, handing the file's pages back
    assert head.weight.interleaved and embedding.weight is head.weight
    assert mapped_pages(file_rows) == 0  # the copy alone counts in resident memory
    ids = torch.tensor([5, ROWS - 1, 512, 5, 300])
    assert same(embedding(ids), expected[ids])
    assert mapped_pages(file_rows) == 0  # the lookups read the copy, not the file
    untied = PackedEmbedding(weight)  # an embedding of its own reads the file's rows in place
    assert untied.weight is weight and same(untied(ids), expected[ids]) and mapped_pages(file_rows) > 0
    del weight, head, embedding, untied, file_rows
    mapping.close()


def test_the_file_s_pages_leave_as_the_copy_is_made(tmp_path: Path) -> None:
    mapping, weight = mapped_weight(tmp_path / "head.bin", rows=64 * ROWS)  # 68 MiB, an LM head's size
    file_rows = weight.parts[0].data
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from the resident memory now
    before = peak_kib()
    interleaved = weight.interleave()
    assert interleaved.interleaved and mapped_pages(file_rows) == 0
    assert (peak_kib() - before) * 1024 < file_rows.numel() // 2  # never the copy and the whole file at once
    del weight, interleaved, file_rows
    mapping.close()
