"""KV managers without a model: a block pool over a KV cache of tiny blocks (K and V of one value per token)."""

from __future__ import annotations

import torch

from statelm.engine.block_pool import BlockPool
from statelm.engine.kv_cache import KVCache
from statelm.engine.kv_manager import KVManager


def kv_manager(num_blocks: int, block_size: int, *, layers: int = 1, head_dim: int = 1, **pool: object) -> KVManager:
    """A KVManager of num_blocks blocks of block_size tokens (pool: BlockPool's other arguments)."""
    cache = KVCache(layers, num_blocks, block_size, 1, head_dim, torch.float32, "cpu")
    return KVManager(BlockPool(num_blocks, block_size, **pool), cache)  # type: ignore[arg-type]
