"""Weight matrices kept quantized in 32-value blocks, and run through statelm's weight-only quantized matmul.

The kernel widens each weight block to float32 in registers and multiplies it into float32 activations, so
its result differs from a float matmul on the dequantized matrix by float rounding only.

Two packed kinds, both with a float32 scale per block of 32 values along the input dimension:

- `q8`: int8 values, w = d·q. GGUF Q8_0 packs into it exactly; Q5_0, Q5_1, Q2_K…Q6_K are dequantized and
  re-quantized into it (symmetric int8 per 32 values: a relative error of at most 1/254 of each block's
  largest weight, far below what 5- and 6-bit sources already carry; 2- and 3-bit sources gain nothing).
- `q4`: 4-bit values 0…15, w = d·q + m. GGUF Q4_0 (m = −8d) and Q4_1 pack into it exactly.

Float checkpoints quantize at load with `quantize`: int8 → `q8`, int4 → `q4` (asymmetric: min and max of each
block map to 0 and 15, which fits skewed blocks better than Q4_0's symmetric grid).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from statelm.kernels.build import load_kernels

BLOCK = 32
KINDS = ("q8", "q4")
Q = GGMLQuantizationType


@dataclass
class PackedWeight:
    """A [out_features, in_features] matrix in a packed kind: values, per-block scales, and mins for q4."""

    kind: str
    out_features: int
    in_features: int
    values: torch.Tensor  # q8: int8 [out, in]; q4: uint8 [out, in / 2]
    scales: torch.Tensor  # float32 [out, in / 32]
    mins: torch.Tensor | None = None  # q4: float32 [out, in / 32]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] float32 @ W.T -> [M, out] float32, activations kept in float32."""
        load_kernels()
        return torch.ops.statelm.quantized_matmul(x.float().contiguous(), self.values, self.scales, self.mins)

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix [out, in]."""
        return self._dequantize_rows(slice(None))

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids [T] of the matrix, dequantized to float32 [T, in]."""
        return self._dequantize_rows(ids)

    def select_rows(self, index: torch.Tensor) -> PackedWeight:
        """The matrix of rows index (new row i is old row index[i])."""
        take = [t.index_select(0, index) if t is not None else None for t in (self.values, self.scales, self.mins)]
        return PackedWeight(self.kind, int(index.numel()), self.in_features, take[0], take[1], take[2])

    @staticmethod
    def concat(weights: list[PackedWeight]) -> PackedWeight:
        """One matrix of the given ones' rows stacked in order (all of one kind and input size)."""
        first = weights[0]
        if any(w.kind != first.kind or w.in_features != first.in_features for w in weights):
            raise ValueError("only weights of one kind and input size can be concatenated")
        mins = torch.cat([w.mins for w in weights]) if first.mins is not None else None  # type: ignore[misc]
        return PackedWeight(
            first.kind,
            sum(w.out_features for w in weights),
            first.in_features,
            torch.cat([w.values for w in weights]),
            torch.cat([w.scales for w in weights]),
            mins,
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
        blocks = self.in_features // BLOCK
        width = self.in_features // 2 if self.kind == "q4" else self.in_features
        dtype = torch.uint8 if self.kind == "q4" else torch.int8
        ok = (
            self.kind in KINDS
            and self.in_features % BLOCK == 0
            and self.values.dtype == dtype
            and tuple(self.values.shape) == (self.out_features, width)
            and self.scales.dtype == torch.float32
            and tuple(self.scales.shape) == (self.out_features, blocks)
            and (self.mins is None) == (self.kind != "q4")
            and (self.mins is None or tuple(self.mins.shape) == (self.out_features, blocks))
        )
        if not ok:
            shape = f"{self.out_features}x{self.in_features}"
            raise ValueError(f"tensors do not make a {self.kind} weight of shape {shape}")

    def _dequantize_rows(self, rows: slice | torch.Tensor) -> torch.Tensor:
        values, scales = self.values[rows], self.scales[rows]
        count = values.shape[0]
        if self.kind == "q8":
            blocks = values.view(count, -1, BLOCK).float() * scales.unsqueeze(-1)
        else:
            assert self.mins is not None
            packed = values.view(count, -1, BLOCK // 2)
            levels = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
            blocks = levels * scales.unsqueeze(-1) + self.mins[rows].unsqueeze(-1)
        return blocks.reshape(count, self.in_features)


def pack_gguf(tensor_type: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """A GGUF tensor's raw blocks (as gguf.GGUFReader gives them) as a packed weight of shape (out, in)."""
    out_features, in_features = shape
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(out_features, -1)
    if tensor_type == Q.Q8_0:  # blocks of fp16 d, 32 int8
        blocks = raw.reshape(out_features, -1, 34)
        scales = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)[..., 0]
        values = blocks[:, :, 2:].copy().view(np.int8).reshape(out_features, in_features)
        return _weight("q8", shape, values, scales, None)
    if tensor_type in (Q.Q4_0, Q.Q4_1):  # blocks of fp16 d (, fp16 m), 16 bytes of nibbles
        header = 2 if tensor_type == Q.Q4_0 else 4
        blocks = raw.reshape(out_features, -1, header + 16)
        halves = blocks[:, :, :header].copy().view(np.float16).astype(np.float32)
        scales = halves[..., 0]
        mins = -8.0 * scales if tensor_type == Q.Q4_0 else halves[..., 1]
        values = blocks[:, :, header:].reshape(out_features, in_features // 2)
        return _weight("q4", shape, values, scales, mins)
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
        return _weight("q8", (out_features, in_features), values.reshape(out_features, in_features), scales, None)
    if kind == "int4":
        low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
        scales = (high - low) / 15.0
        inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        levels = torch.round((blocks - low.unsqueeze(-1)) * inverse.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
        packed = levels[..., : BLOCK // 2] | (levels[..., BLOCK // 2 :] << 4)
        return _weight("q4", (out_features, in_features), packed.reshape(out_features, -1), scales, low)
    raise ValueError(f"unknown quantization {kind!r}; choose int8 or int4")


def _weight(
    kind: str,
    shape: tuple[int, int],
    values: np.ndarray | torch.Tensor,
    scales: np.ndarray | torch.Tensor,
    mins: np.ndarray | torch.Tensor | None,
) -> PackedWeight:
    def tensor(array: np.ndarray | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array) if isinstance(array, np.ndarray) else array).contiguous()

    weight = PackedWeight(
        kind,
        shape[0],
        shape[1],
        tensor(values),
        tensor(scales).float(),
        None if mins is None else tensor(mins).float(),
    )
    weight.check()
    return weight
