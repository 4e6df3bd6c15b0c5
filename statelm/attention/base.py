"""What a model and its attention backend see of one batched forward over the paged KV cache: the KV view, the
step's attention metadata, and the backend interface."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from statelm.attention.kv_format import KVFormat
from statelm.attention.layer_kv import LayerKV


@dataclass
class AttentionMetadata:
    """Layout of one step's flat batch: which tokens belong to which sequence and where their KV lives.

    Tokens of all scheduled sequences are concatenated into one flat batch of T tokens.
    Sequence i owns tokens query_start[i]:query_start[i+1]; these are the last
    query_lens[i] positions of its context of seq_lens[i] tokens (cached + new).

    The lists serve host-side planning; the device tensors and the two bounds serve backends that must not
    synchronise with the host (a CUDA graph replays them with new contents). Unset, they are derived from the
    lists. In a captured decode step, padding sequences have seq_len 0 and their tokens slot -1.
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset where each new token's K/V goes
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    query_lens: list[int]  # [B] new tokens per sequence this step
    seq_lens: list[int]  # [B] context length per sequence after this step
    query_start: list[int]  # [B + 1] cumulative offsets into the flat batch
    seq_lens_tensor: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [B] int64, on the device
    query_start_tensor: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [B + 1] int64
    max_query_len: int = 0  # bounds for sizing kernel grids (a graph's max_seq_len is the model's max length)
    max_seq_len: int = 0

    def __post_init__(self) -> None:
        device = self.block_tables.device
        if self.seq_lens_tensor is None:
            self.seq_lens_tensor = torch.tensor(self.seq_lens, dtype=torch.int64, device=device)
        if self.query_start_tensor is None:
            self.query_start_tensor = torch.tensor(self.query_start, dtype=torch.int64, device=device)
        self.max_query_len = self.max_query_len or max(self.query_lens, default=0)
        self.max_seq_len = self.max_seq_len or max(self.seq_lens, default=0)

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        return len(self.query_lens)


class KVView(Protocol):
    """The paged KV cache as a model reads and writes it: its format and per layer its blocks (LayerKV: keys
    [num_blocks, num_kv_heads, head_dim, block_size], values [num_blocks, num_kv_heads, block_size, head_dim], and
    q8_0's scales), also as lists per plane for the fused decoder (the engine's KVCache is one)."""

    format: KVFormat
    layers: list[LayerKV]

    @property
    def k(self) -> list[torch.Tensor]:
        """Every layer's key blocks."""
        ...

    @property
    def v(self) -> list[torch.Tensor]:
        """Every layer's value blocks."""
        ...

    @property
    def k_scale(self) -> list[torch.Tensor]:
        """Every layer's key scales (q8_0; empty for float formats)."""
        ...

    @property
    def v_scale(self) -> list[torch.Tensor]:
        """Every layer's value scales (q8_0; empty for float formats)."""
        ...


class AttentionBackend(Protocol):
    """Writes the step's K/V into the paged cache and computes attention for every query token."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        cache: LayerKV,  # this layer's blocks (statelm.attention.layer_kv's layout, in the cache's format)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Attend each query token over its own sequence's context (causal)."""
        ...
