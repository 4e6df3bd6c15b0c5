"""Weight matrices kept in GGUF's quantized block formats, multiplied by statelm's kernel where they lie.

A GGUF tensor is used as the file stores it: its blocks row-major, one row per output feature, read in place
from the memory-mapped file (no re-quantization). On the kernels path a matrix's bytes are by default also
rearranged once at load into the kernel's interleaved layout (`--repack`, `BlockMatrix.interleave`: a few output
columns' rows side by side, word by word, as llama.cpp's CPU back end repacks its blocks), in memory, never on disk;
results are bit-identical either way. The kernel (csrc/gguf_matmul*.cpp) decodes the blocks of a
few output columns at a time into a small per-thread buffer and multiplies them with one of three arithmetics
(`ARITHMETICS`): `float32` (the float model's: the weights as gguf-py dequantizes them, times float32
activations), `int8` (activations quantized per row and block of 32 values, of 256 for the K-quants and IQ4_XS, as
llama.cpp's CPU kernels do, every group's dot product exact in integers and a superblock's groups summed in
integers) or `int16` (the same with 16-bit activations: within float rounding of `float32`, at near-int8 speed).
Every arithmetic gives a row the same bits whatever the batch and the CPU class.

Formats read natively: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS
(`BLOCK_TYPES`). A float checkpoint quantized at load (`--quantization int8|int4`) becomes Q8_0 or Q4_1 blocks,
quantized as gguf-py's `quantize` does.
"""

from __future__ import annotations

import dataclasses
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
INTERLEAVED_TYPE = 1 << 8  # a type id with this bit names an interleaved block matrix (csrc/gguf_tiles.h)
QUANTIZE_TYPES = {"int8": Q.Q8_0, "int4": Q.Q4_1}  # --quantization of float checkpoints


@dataclass(frozen=True)
class BlockMatrix:
    """One matrix [rows, in_features] in a GGML block format: uint8 data [rows, row bytes], as a GGUF stores it."""

    qtype: GGMLQuantizationType
    data: torch.Tensor
    in_features: int
    interleaved: torch.Tensor | None = None  # the same blocks in the kernel's interleaved layout, if made
    mapped: bool = False  # data views a mapped file: once interleaved, its pages are handed back to the OS

    @classmethod
    def of(
        cls,
        qtype: GGMLQuantizationType,
        data: torch.Tensor | np.ndarray,
        shape: tuple[int, int],
        mapped: bool = False,
    ) -> BlockMatrix:
        """The matrix of shape (rows, in_features) whose blocks are data (any shape holding exactly its bytes);
        mapped: data views a mapped file."""
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
        return cls(qtype, tensor.reshape(rows, row_bytes), in_features, mapped=mapped)

    @property
    def rows(self) -> int:
        """Output features."""
        return int(self.data.shape[0])

    def interleave(self) -> BlockMatrix:
        """This matrix with its blocks also in the kernel's interleaved layout (the same bytes, the rows of a few
        output columns word by word side by side: the matmul loads what it would otherwise transpose), or as it is
        where the loaded kernels have no such layout for the format."""
        if self.interleaved is not None:
            return self
        load_kernels()
        # a mapped file's pages are handed back as they are copied (MADV_PAGEOUT, a hint: what is read again later
        # comes back from the disk), so that the copy does not count twice; nothing reads them again: lookups of a
        # tied embedding read the copy (PackedEmbedding)
        interleaved = torch.ops.statelm.gguf_interleave(self.data, int(self.qtype), self.mapped)
        if not interleaved.numel():
            return self
        return dataclasses.replace(self, interleaved=interleaved)

    def kernel_argument(self) -> tuple[torch.Tensor, int]:
        """The data and type id torch.ops.statelm.gguf_matmul takes for this matrix: interleaved where made."""
        if self.interleaved is None:
            return self.data, int(self.qtype)
        return self.interleaved[: self.rows], int(self.qtype) | INTERLEAVED_TYPE


class PackedWeight:
    """A weight [out_features, in_features] as block matrices whose rows stack into its output features (a fused
    projection such as q, k and v keeps each part in its own format)."""

    def __init__(self, parts: Sequence[BlockMatrix]) -> None:
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("a packed weight needs one or more block matrices of one input size")
        self.parts = tuple(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.rows for p in parts)
        self._kernel_arguments: tuple[list[torch.Tensor], list[int]] | None = None

    @property
    def kind(self) -> str:
        """The parts' formats, e.g. `Q4_K` or `Q4_K+Q6_K`."""
        return "+".join(dict.fromkeys(p.qtype.name for p in self.parts))

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks."""
        return sum(p.data.numel() for p in self.parts)

    @property
    def interleaved(self) -> bool:
        """Whether the matmul reads an interleaved copy of every part (see BlockMatrix.interleave)."""
        return all(p.interleaved is not None for p in self.parts)

    def interleave(self) -> PackedWeight:
        """This weight with its parts interleaved where the kernels can (bit-identical results, faster reads)."""
        return PackedWeight([p.interleave() for p in self.parts])

    def in_place(self) -> PackedWeight:
        """This weight read from its blocks as they lie (no interleaved copies)."""
        return PackedWeight([dataclasses.replace(p, interleaved=None) for p in self.parts])

    def kernel_arguments(self) -> tuple[list[torch.Tensor], list[int]]:
        """The parts' data and type ids, as torch.ops.statelm.gguf_matmul takes them (made once: a decode step
        passes them for every matmul)."""
        if self._kernel_arguments is None:
            data, types = zip(*(p.kernel_argument() for p in self.parts), strict=True)
            self._kernel_arguments = list(data), list(types)
        return self._kernel_arguments

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
        """Rows ids [T] of the matrix, dequantized to float32 [T, in] (from the interleaved copy where made)."""
        load_kernels()
        if len(self.parts) == 1:
            return torch.ops.statelm.gguf_dequantize(*self.parts[0].kernel_argument(), ids)
        return self.dequantize()[ids]

    def row_slice(self, start: int, end: int) -> PackedWeight:
        """Output features start:end of this weight, viewing its blocks (no copy; interleaved copies are not kept)."""
        parts, offset = [], 0
        for part in self.parts:
            low, high = max(start - offset, 0), min(end - offset, part.rows)
            if low < high:
                parts.append(dataclasses.replace(part, data=part.data[low:high], interleaved=None))
            offset += part.rows
        return PackedWeight(parts)

    @staticmethod
    def concat(weights: Sequence[PackedWeight]) -> PackedWeight:
        """One weight of the given ones' rows stacked in order (no copy: their block matrices side by side)."""
        return PackedWeight([part for weight in weights for part in weight.parts])


def matmul_groups(calls: Sequence[tuple[torch.Tensor, PackedWeight, str]]) -> list[torch.Tensor]:
    """x @ W.T for each (x, W, arithmetic) in one kernel call, the threads sharing all of them out together: each
    result bit for bit W.matmul(x, arithmetic)'s (a mixture of experts' experts, each on its own tokens)."""
    load_kernels()
    xs, data, types, parts, arithmetics = [], [], [], [], []
    for x, weight, arithmetic in calls:
        weight_data, weight_types = weight.kernel_arguments()
        xs.append(x.float().contiguous())
        data += weight_data
        types += weight_types
        parts.append(len(weight_data))
        arithmetics.append(ARITHMETICS[arithmetic])
    return list(torch.ops.statelm.gguf_matmul_groups(xs, data, types, parts, arithmetics))


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
