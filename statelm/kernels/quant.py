"""Weight matrices kept quantized in 32-value blocks, and run through statelm's quantized matmul kernel.

The kernel (csrc/qmatmul*.cpp) keeps activations in float32, so only float rounding separates its result from
a float matmul on the dequantized weights; or, with int8 activations, it computes as llama.cpp's CPU kernels
do: activations quantized to int8 per row and block of 32 values, each block's dot product exact in integers,
2.5-3x faster on many rows. What int8 activations cost against the float model is measured by
bench/accuracy.py and reported in docs/benchmarks.md.

Two packed kinds, both with a float32 scale per block of 32 values along the input dimension:

- `q8`: int8 values, w = d·q. GGUF Q8_0 packs into it exactly; Q5_0, Q5_1, Q2_K…Q6_K are dequantized and
  re-quantized into it (symmetric int8 per 32 values: a relative error of at most 1/254 of each block's
  largest weight, far below what 5- and 6-bit sources already carry; 2- and 3-bit sources gain nothing).
- `q4`: 4-bit values 0…15, w = d·q + m. GGUF Q4_0 (m = −8d) and Q4_1 pack into it exactly.

Float checkpoints quantize at load with `quantize`: int8 → `q8`, int4 → `q4` (asymmetric: min and max of each
block map to 0 and 15, which fits skewed blocks better than Q4_0's symmetric grid).

Layout: output rows are interleaved in groups of 8 (the last group padded with zeros), so that one 32-byte
load gives the kernel 4 consecutive values of 8 rows. Per group and block: q8 values [8 quads, 8 rows, 4],
q4 bytes [4 quads, 8 rows, 4] whose low nibbles hold the block's values 0…15 and high nibbles 16…31 (GGML's
nibble order, so a Q4 block's 16 bytes move as they are), scales and mins [8 rows].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from statelm.kernels.build import load_kernels

BLOCK = 32
GROUP = 8  # output rows interleaved together
KINDS = ("q8", "q4")
Q = GGMLQuantizationType


@dataclass
class PackedWeight:
    """A [out_features, in_features] matrix in a packed kind: values, per-block scales, and mins for q4.

    The tensors are in the interleaved layout described in the module docstring: values [groups, blocks, quads,
    8, 4] (uint8 for q4, int8 for q8), scales and mins float32 [groups, blocks, 8], groups = ceil(out / 8).
    """

    kind: str
    out_features: int
    in_features: int
    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None  # q4 only

    @classmethod
    def from_rows(
        cls, kind: str, values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
    ) -> PackedWeight:
        """A weight from row-major blocks: values [out, in] (q8) or [out, in / 2] (q4, GGML nibbles), scales
        and mins [out, in / 32]."""
        out_features, blocks = scales.shape
        groups = -(-out_features // GROUP)
        pad = groups * GROUP - out_features
        width = BLOCK // 2 if kind == "q4" else BLOCK

        def interleave(tensor: torch.Tensor, inner: tuple[int, ...]) -> torch.Tensor:
            padded = torch.nn.functional.pad(tensor.reshape(out_features, -1), (0, 0, 0, pad))
            grouped = padded.reshape(groups, GROUP, blocks, *inner)
            return grouped.movedim(1, -2 if inner else -1).contiguous()

        weight = cls(
            kind,
            out_features,
            blocks * BLOCK,
            interleave(values.contiguous(), (width // 4, 4)),
            interleave(scales.float(), ()),
            None if mins is None else interleave(mins.float(), ()),
        )
        weight.check()
        return weight

    def rows(self, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row-major values, scales and mins (as from_rows takes them) of all rows, or of rows index."""
        rows = torch.arange(self.out_features) if index is None else index
        group, member = rows // GROUP, rows % GROUP
        values = self.values[group, :, :, member, :].reshape(rows.numel(), -1)  # [rows, blocks, quads, 4]
        scales = self.scales[group, :, member]
        mins = None if self.mins is None else self.mins[group, :, member]
        return values, scales, mins

    def matmul(self, x: torch.Tensor, int8_activations: bool = False) -> torch.Tensor:
        """x [M, in] float32 @ W.T -> [M, out] float32; activations stay float32 or are quantized to int8."""
        load_kernels()
        x = x.float().contiguous()
        return torch.ops.statelm.quantized_matmul(
            x, self.values, self.scales, self.mins, self.out_features, int8_activations
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix [out, in]."""
        return self._dequantize(None)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids [T] of the matrix, dequantized to float32 [T, in]."""
        return self._dequantize(ids)

    def select_rows(self, index: torch.Tensor) -> PackedWeight:
        """The matrix of rows index (new row i is old row index[i])."""
        return PackedWeight.from_rows(self.kind, *self.rows(index))

    @staticmethod
    def concat(weights: list[PackedWeight]) -> PackedWeight:
        """One matrix of the given ones' rows stacked in order (all of one kind and input size)."""
        first = weights[0]
        if any(w.kind != first.kind or w.in_features != first.in_features for w in weights):
            raise ValueError("only weights of one kind and input size can be concatenated")
        if all(w.out_features % GROUP == 0 for w in weights):  # whole groups: stack them as they are
            mins = torch.cat([w.mins for w in weights]) if first.mins is not None else None  # type: ignore[misc]
            out = sum(w.out_features for w in weights)
            values, scales = torch.cat([w.values for w in weights]), torch.cat([w.scales for w in weights])
            return PackedWeight(first.kind, out, first.in_features, values, scales, mins)
        parts = [w.rows() for w in weights]
        mins = torch.cat([p[2] for p in parts]) if first.mins is not None else None  # type: ignore[misc]
        return PackedWeight.from_rows(
            first.kind, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), mins
        )

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors to store (see from_state)."""
        tensors = {"values": self.values, "scales": self.scales}
        return tensors if self.mins is None else {**tensors, "mins": self.mins}

    @classmethod
    def from_state(
        cls, kind: str, out_features: int, in_features: int, tensors: dict[str, torch.Tensor]
    ) -> PackedWeight:
        """A weight back from state() tensors, checked against its kind and shape."""
        weight = cls(kind, out_features, in_features, tensors["values"], tensors["scales"], tensors.get("mins"))
        weight.check()
        return weight

    @property
    def nbytes(self) -> int:
        """Bytes the packed tensors take."""
        return sum(t.numel() * t.element_size() for t in self.state().values())

    def check(self) -> None:
        """Raise ValueError unless the tensors fit the kind and shape."""
        groups, blocks = -(-self.out_features // GROUP), self.in_features // BLOCK
        quads = 4 if self.kind == "q4" else 8
        dtype = torch.uint8 if self.kind == "q4" else torch.int8
        ok = (
            self.kind in KINDS
            and self.in_features % BLOCK == 0
            and self.values.dtype == dtype
            and tuple(self.values.shape) == (groups, blocks, quads, GROUP, 4)
            and self.scales.dtype == torch.float32
            and tuple(self.scales.shape) == (groups, blocks, GROUP)
            and (self.mins is None) == (self.kind != "q4")
            and (self.mins is None or tuple(self.mins.shape) == (groups, blocks, GROUP))
        )
        if not ok:
            shape = f"{self.out_features}x{self.in_features}"
            raise ValueError(f"tensors do not make a {self.kind} weight of shape {shape}")

    def _dequantize(self, index: torch.Tensor | None) -> torch.Tensor:
        values, scales, mins = self.rows(index)
        count = values.shape[0]
        if self.kind == "q8":
            blocks = values.view(count, -1, BLOCK).float() * scales.unsqueeze(-1)
        else:
            assert mins is not None
            packed = values.view(count, -1, BLOCK // 2)
            levels = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
            blocks = levels * scales.unsqueeze(-1) + mins.unsqueeze(-1)
        return blocks.reshape(count, self.in_features)


def pack_gguf(tensor_type: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """A GGUF tensor's raw blocks (as gguf.GGUFReader gives them) as a packed weight of shape (out, in)."""
    out_features, in_features = shape
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(out_features, -1)
    if tensor_type == Q.Q8_0:  # blocks of fp16 d, 32 int8
        blocks = raw.reshape(out_features, -1, 34)
        scales = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)[..., 0]
        values = blocks[:, :, 2:].copy().view(np.int8).reshape(out_features, in_features)
        return _weight("q8", values, scales, None)
    if tensor_type in (Q.Q4_0, Q.Q4_1):  # blocks of fp16 d (, fp16 m), 16 bytes of nibbles
        header = 2 if tensor_type == Q.Q4_0 else 4
        blocks = raw.reshape(out_features, -1, header + 16)
        halves = blocks[:, :, :header].copy().view(np.float16).astype(np.float32)
        scales = halves[..., 0]
        mins = -8.0 * scales if tensor_type == Q.Q4_0 else halves[..., 1]
        values = blocks[:, :, header:].reshape(out_features, in_features // 2)
        return _weight("q4", values, scales, mins)
    floats = np.asarray(gguf_dequantize(data, tensor_type), dtype=np.float32).reshape(shape)
    return quantize(torch.from_numpy(floats), "int8")


def quantize(weight: torch.Tensor, kind: str) -> PackedWeight:
    """A float matrix [out, in] (in a multiple of 32) quantized to `int8` (q8) or `int4` (q4)."""
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"input size {in_features} is not a multiple of {BLOCK}")
    blocks = weight.detach().float().reshape(out_features, -1, BLOCK)
    if kind == "int8":
        scales = blocks.abs().amax(dim=-1) / 127.0
        inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        values = torch.round(blocks * inverse.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return _weight("q8", values.reshape(out_features, in_features), scales, None)
    if kind == "int4":
        low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
        scales = (high - low) / 15.0
        inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        levels = torch.round((blocks - low.unsqueeze(-1)) * inverse.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
        packed = levels[..., : BLOCK // 2] | (levels[..., BLOCK // 2 :] << 4)
        return _weight("q4", packed.reshape(out_features, -1), scales, low)
    raise ValueError(f"unknown quantization {kind!r}; choose int8 or int4")


def _weight(
    kind: str,
    values: np.ndarray | torch.Tensor,
    scales: np.ndarray | torch.Tensor,
    mins: np.ndarray | torch.Tensor | None,
) -> PackedWeight:
    def tensor(array: np.ndarray | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array) if isinstance(array, np.ndarray) else array)

    return PackedWeight.from_rows(kind, tensor(values), tensor(scales), None if mins is None else tensor(mins))
