"""Weight matrices kept in GGUF's quantized block formats, multiplied by statelm's kernel where they lie.

A GGUF tensor is used as the file stores it: its blocks row-major, one row per output feature, read in place
from the memory-mapped file (no re-packing, no copy). The kernel (csrc/gguf_matmul*.cpp) decodes the blocks of a
few output columns at a time into a small per-thread buffer and multiplies them with one of three arithmetics
(`ARITHMETICS`): `float32` (the float model's: the weights as gguf-py dequantizes them, times float32
activations), `int8` (activations quantized per row and block of 32 values, as llama.cpp's CPU kernels do, every
group's dot product exact in integers) or `int16` (the same with 16-bit activations: within float rounding of
`float32`, at near-int8 speed). Every arithmetic gives a row the same bits whatever the batch and the CPU class.

Formats read natively: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS
(`BLOCK_TYPES`). A float checkpoint quantized at load (`--quantization int8|int4`) becomes Q8_0 or Q4_1 blocks,
quantized as gguf-py's `quantize` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from statelm.kernels.build import load_kernels

Q = GGMLQuantizationType
BLOCK_TYPES = frozenset(
    {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS}
)
ARITHMETICS = {"float32": 0, "int8": 1, "int16": 2}  # the kernel's codes
QUANTIZE_TYPES = {"int8": Q.Q8_0, "int4": Q.Q4_1}  # --quantization of float checkpoints


@dataclass(frozen=True)
class BlockMatrix:
    """One matrix [rows, in_features] in a GGML block format: uint8 data [rows, row bytes], as a GGUF stores it."""

    qtype: GGMLQuantizationType
    data: torch.Tensor
    in_features: int

    @classmethod
    def of(cls, qtype: GGMLQuantizationType, data: torch.Tensor | np.ndarray, shape: tuple[int, int]) -> BlockMatrix:
        """The matrix of shape (rows, in_features) whose blocks are data (any shape holding exactly its bytes)."""
        if qtype not in BLOCK_TYPES:
            raise ValueError(f"{qtype.name} is not a block format statelm's kernel reads")
        rows, in_features = shape
        values, size = GGML_QUANT_SIZES[qtype]
        if in_features % values:
            raise ValueError(f"input size {in_features} is not a multiple of {qtype.name}'s {values}-value blocks")
        tensor = torch.as_tensor(data) if isinstance(data, np.ndarray) else data
        row_bytes = in_features // values * size
        if tensor.dtype != torch.uint8 or tensor.numel() != rows * row_bytes:
            raise ValueError(f"{tuple(tensor.shape)} {tensor.dtype} is not a {qtype.name} matrix of shape {shape}")
        return cls(qtype, tensor.reshape(rows, row_bytes), in_features)

    @property
    def rows(self) -> int:
        """Output features."""
        return int(self.data.shape[0])


class PackedWeight:
    """A weight [out_features, in_features] as block matrices whose rows stack into its output features (a fused
    projection such as q, k and v keeps each part in its own format)."""

    def __init__(self, parts: Sequence[BlockMatrix]) -> None:
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("a packed weight needs one or more block matrices of one input size")
        self.parts = tuple(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.rows for p in parts)

    @property
    def kind(self) -> str:
        """The parts' formats, e.g. `Q4_K` or `Q4_K+Q6_K`."""
        return "+".join(dict.fromkeys(p.qtype.name for p in self.parts))

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks."""
        return sum(p.data.numel() for p in self.parts)

    def kernel_arguments(self) -> tuple[list[torch.Tensor], list[int]]:
        """The parts' data and ggml type ids, as torch.ops.statelm.gguf_matmul takes them."""
        return [p.data for p in self.parts], [int(p.qtype) for p in self.parts]

    def matmul(self, x: torch.Tensor, arithmetic: str = "float32") -> torch.Tensor:
        """x [M, in] float32 @ W.T -> [M, out] float32, in one of ARITHMETICS."""
        load_kernels()
        data, types = self.kernel_arguments()
        return torch.ops.statelm.gguf_matmul(x.float().contiguous(), data, types, ARITHMETICS[arithmetic])

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix [out, in], as gguf-py dequantizes it."""
        load_kernels()
        return torch.cat([torch.ops.statelm.gguf_dequantize(p.data, int(p.qtype), None) for p in self.parts])

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids [T] of the matrix, dequantized to float32 [T, in]."""
        load_kernels()
        if len(self.parts) == 1:
            part = self.parts[0]
            return torch.ops.statelm.gguf_dequantize(part.data, int(part.qtype), ids)
        return self.dequantize()[ids]

    @staticmethod
    def concat(weights: Sequence[PackedWeight]) -> PackedWeight:
        """One weight of the given ones' rows stacked in order (no copy: their block matrices side by side)."""
        return PackedWeight([part for weight in weights for part in weight.parts])


def quantize(weight: torch.Tensor, kind: str) -> PackedWeight:
    """A float matrix [out, in] (in a multiple of 32) as Q8_0 (`int8`) or Q4_1 (`int4`) blocks, with gguf-py's
    arithmetic: Q8_0 scales each block by its largest magnitude over 127 and rounds half away from zero; Q4_1 maps
    its minimum to 0 and (max - min) / 15 per step, rounding half up; scales and minimums are stored as float16."""
    if kind not in QUANTIZE_TYPES:
        raise ValueError(f"unknown quantization {kind!r}; choose int8 or int4")
    rows, in_features = weight.shape
    if in_features % 32:
        raise ValueError(f"input size {in_features} is not a multiple of 32")
    blocks = weight.detach().float().reshape(rows, -1, 32)

    def halves(values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.float16).unsqueeze(-1).view(torch.uint8)

    if kind == "int8":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        magnitude = (blocks * inverse).abs()
        whole = magnitude.floor()
        rounded = whole + (2 * (magnitude - whole)).floor()  # half away from zero, exactly (as ggml's roundf)
        levels = ((blocks * inverse).sign() * rounded).to(torch.int8).view(torch.uint8)
        data = torch.cat([halves(d.squeeze(-1)), levels], dim=-1)
    else:
        high, low = blocks.amax(dim=-1, keepdim=True), blocks.amin(dim=-1, keepdim=True)
        d = (high - low) / 15
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        levels = ((blocks - low) * inverse + 0.5).trunc().clamp(0, 15).to(torch.uint8)
        nibbles = levels[..., :16] | (levels[..., 16:] << 4)
        data = torch.cat([halves(d.squeeze(-1)), halves(low.squeeze(-1)), nibbles], dim=-1)
    return PackedWeight([BlockMatrix.of(QUANTIZE_TYPES[kind], data.contiguous(), (rows, in_features))])
