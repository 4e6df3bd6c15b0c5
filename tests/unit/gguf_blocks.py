"""Random GGUF blocks of every format the kernels read, for tests: random bytes with sane float16 fields."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# Byte offsets of each block's float16 fields (scales, and minimums where the format has them).
HALF_FIELDS = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}
FORMATS = list(HALF_FIELDS)
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]  # blocks of 256 values


def random_blocks(
    qtype: Q, rows: int, cols: int, rng: np.random.Generator, scales: tuple[float, float] = (0.001, 0.05)
) -> np.ndarray:
    """Valid raw blocks [rows, row bytes] of a [rows, cols] matrix: every level and sub-scale bit random, float16
    scales uniform in `scales` (Q4_1 and Q5_1 minimums negative, as a quantizer makes them)."""
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // values, size), dtype=np.uint8)
    for field, offset in enumerate(HALF_FIELDS[qtype]):
        halves = rng.uniform(*scales, size=len(blocks)).astype(np.float16)
        if qtype in (Q.Q4_1, Q.Q5_1) and field == 1:
            halves = -halves
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // values * size)


def random_columns(qtype: Q) -> int:
    """An input size the format can hold that is not a multiple of the kernels' K chunk (512 values) (an even
    number of 32-value blocks: paired formats interleave)."""
    return 768 if qtype in K_QUANTS else 832
