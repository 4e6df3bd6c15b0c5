"""One layer's paged K/V blocks as the attention backends read and write them (the layout statelm.engine.kv_cache
allocates): keys [blocks, H, D, S] transposed per block, values [blocks, H, S, D], and for q8_0 their float16 scales."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from statelm.attention.kv_format import Q8_GROUP, KVFormat, dequantize_q8_0, pack_q8_0, quantize_q8_0, unpack_q8_0


class LayerKV(NamedTuple):
    """One layer's block tensors (scales only for q8_0)."""

    k: torch.Tensor  # [blocks, H, D, S]
    v: torch.Tensor  # [blocks, H, S, D]
    k_scale: torch.Tensor | None = None  # [blocks, H, D / 32, S] float16
    v_scale: torch.Tensor | None = None  # [blocks, H, S, D / 32] float16

    @classmethod
    def allocate(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, fmt: KVFormat, device: torch.device
    ) -> LayerKV:
        """Zeroed blocks of fmt for one layer."""
        k = _zeros((num_blocks, num_kv_heads, head_dim, block_size), fmt.element, device)
        v = _zeros((num_blocks, num_kv_heads, block_size, head_dim), fmt.element, device)
        if not fmt.quantized:
            return cls(k, v)
        groups = head_dim // Q8_GROUP
        k_scale = _zeros((num_blocks, num_kv_heads, groups, block_size), torch.float16, device)
        v_scale = _zeros((num_blocks, num_kv_heads, block_size, groups), torch.float16, device)
        return cls(k, v, k_scale, v_scale)

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.v.shape[2]

    def planes(self) -> list[tuple[torch.Tensor, bool]]:
        """Every block tensor with whether it is transposed (token axis last), keys' first."""
        planes = [(self.k, True), (self.v, False)]
        if self.k_scale is not None and self.v_scale is not None:
            planes += [(self.k_scale, True), (self.v_scale, False)]
        return planes

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write K and V [T, H, D] of the model into slots (block * S + offset), rounded or quantized (torch ops)."""
        size = self.block_size
        blocks, offsets = slots // size, slots % size
        if self.k_scale is None:
            self.k[blocks, :, :, offsets] = k.to(self.k.dtype)
            self.v[blocks, :, offsets, :] = v.to(self.v.dtype)
            return
        planes = self.planes()
        for rows, (cache, transposed), (scales, _) in zip((k, v), planes[:2], planes[2:], strict=True):
            values, scale = quantize_q8_0(rows)
            if transposed:
                cache[blocks, :, :, offsets], scales[blocks, :, :, offsets] = values, scale
            else:
                cache[blocks, :, offsets, :], scales[blocks, :, offsets, :] = values, scale

    def values_of(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [len(index) * S, H, D] of blocks, as stored (float formats) or dequantized to float32 (q8_0)."""
        k, v = (_token_major(plane[index], transposed) for plane, transposed in self.planes()[:2])
        if self.k_scale is None:
            return k, v
        k_scale, v_scale = (_token_major(plane[index], transposed) for plane, transposed in self.planes()[2:])
        return dequantize_q8_0(k, k_scale), dequantize_q8_0(v, v_scale)

    def rows(self, index: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows (kv_format's row form) of the first num_tokens tokens in blocks, on the cache's device."""
        tensors = [_token_major(plane[index], transposed)[:num_tokens] for plane, transposed in self.planes()]
        if self.k_scale is None:
            return tensors[0].contiguous(), tensors[1].contiguous()
        return pack_q8_0(tensors[0], tensors[2]), pack_q8_0(tensors[1], tensors[3])

    def write_rows(self, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fill blocks, in order, with K and V rows (the pool's format, on its device); unused slots become 0."""
        if self.k_scale is None:
            tensors = [keys, values]
        else:
            (k, k_scale), (v, v_scale) = unpack_q8_0(keys), unpack_q8_0(values)
            tensors = [k, v, k_scale, v_scale]
        count, size = len(index), self.block_size
        for (plane, transposed), rows in zip(self.planes(), tensors, strict=True):
            padded = plane.new_zeros((count * size, *rows.shape[1:]))
            padded[: rows.shape[0]] = rows
            blocks = padded.view(count, size, *rows.shape[1:])
            plane.index_copy_(0, index, blocks.permute(0, 2, 3, 1) if transposed else blocks.transpose(1, 2))


def _token_major(blocks: torch.Tensor, transposed: bool) -> torch.Tensor:
    """[n * S, H, X] rows of block tensors [n, H, X, S] (transposed) or [n, H, S, X]."""
    rows = blocks.permute(0, 3, 1, 2) if transposed else blocks.transpose(1, 2)
    return rows.reshape(-1, *rows.shape[2:])


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU from calloc'd pages, which the OS zeroes on first touch rather than at start-up."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    element = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(math.prod(shape) * element, dtype=np.uint8)).view(dtype).view(shape)
