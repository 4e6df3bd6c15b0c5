"""CPU attention backend on statelm's paged attention kernel: reads K/V blocks in place, batch-invariant by design.

The kernel (statelm/kernels/csrc/paged_attention.cpp) computes every (query row, head) with one fixed sequence
of float operations: keys in position order, in chunks aligned to absolute positions, threads split over
sequences, heads and query rows only. A row's result is therefore bitwise the same whatever else shares
its step, however its prompt was chunked, and however many threads run, with no padding or query tricks.
"""

from __future__ import annotations

import torch

from statelm.attention.base import AttentionMetadata
from statelm.attention.layer_kv import LayerKV
from statelm.kernels.build import load_kernels


class CpuKernelAttentionBackend:
    """Paged attention through torch.ops.statelm.paged_attention (CPU tensors; every KV format)."""

    def __init__(self, sliding_window: int | None = None, softcap: float | None = None) -> None:
        load_kernels()
        self.sliding_window = sliding_window
        self.softcap = softcap  # scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache (rounded or quantized), then attend each query over its context."""
        torch.ops.statelm.kv_store(k, v, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.slot_mapping)
        return torch.ops.statelm.paged_attention(
            q,
            cache.k,
            cache.v,
            meta.block_tables,
            meta.seq_lens_tensor,
            meta.query_start_tensor,
            scale,
            self.sliding_window or 0,
            cache.k_scale,
            cache.v_scale,
            self.softcap or 0.0,
        )
