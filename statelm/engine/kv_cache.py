"""Storage of the paged KV cache: per layer, a pool of fixed-size blocks of keys and values."""

from __future__ import annotations

import math

import numpy as np
import torch


class KVCache:
    """K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim] for every layer."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = [_zeros(shape, dtype, torch.device(device)) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, torch.device(device)) for _ in range(num_layers)]

    def copy_block(self, source: int, target: int) -> None:
        """Copy one block's K/V, in every layer, into another block."""
        for cache in (*self.k, *self.v):
            cache[target].copy_(cache[source])

    def gather(self, blocks: list[int], num_tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V of the first num_tokens tokens held in blocks, per layer as CPU tensors [tokens, heads, dim]."""
        index = torch.tensor(blocks, dtype=torch.int64, device=self.k[0].device)

        def take(cache: torch.Tensor) -> torch.Tensor:
            rows = cache.index_select(0, index).flatten(0, 1)[:num_tokens]
            return rows.to("cpu", copy=True).contiguous()

        return [take(cache) for cache in self.k], [take(cache) for cache in self.v]

    def scatter(self, blocks: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Write per-layer K and V [tokens, heads, dim] into blocks, filling them in order."""
        index = torch.tensor(blocks, dtype=torch.int64, device=self.k[0].device)
        for caches, tensors in ((self.k, keys), (self.v, values)):
            for cache, tensor in zip(caches, tensors, strict=True):
                padded = cache.new_zeros((len(blocks) * self.block_size, *cache.shape[2:]))
                padded[: tensor.shape[0]] = tensor.to(cache.device, cache.dtype)
                cache.index_copy_(0, index, padded.view(len(blocks), self.block_size, *cache.shape[2:]))

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one block takes across all layers, K and V."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU from calloc'd pages, which the OS zeroes on first touch rather than at start-up."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    element = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(math.prod(shape) * element, dtype=np.uint8)).view(dtype).view(shape)
