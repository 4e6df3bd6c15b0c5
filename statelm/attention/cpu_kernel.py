"""CPU attention backend on statelm's paged attention kernel: reads K/V blocks in place, batch-invariant by design.

The kernel (statelm/kernels/csrc/paged_attention.cpp) computes every (query row, head) with one fixed sequence
of float operations: keys in position order, in chunks aligned to absolute positions, threads split over
sequences, heads and query rows only. A row's result is therefore bitwise the same whatever else shares
its step, however its prompt was chunked, and however many threads run, with no padding or query tricks.
"""

from __future__ import annotations

import torch

from statelm.attention.base import AttentionMetadata
from statelm.kernels.build import load_kernels


class CpuKernelAttentionBackend:
    """Paged attention through torch.ops.statelm.paged_attention (CPU tensors; any float cache dtype)."""

    def __init__(self, sliding_window: int | None = None) -> None:
        load_kernels()
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend each query over its sequence's context."""
        kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        return torch.ops.statelm.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens_tensor,
            meta.query_start_tensor,
            scale,
            self.sliding_window or 0,
        )
