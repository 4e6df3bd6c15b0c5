"""What an attention backend receives for one batched forward over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Layout of one step's flat batch: which tokens belong to which sequence and where their KV lives.

    Tokens of all scheduled sequences are concatenated into one flat batch of T tokens.
    Sequence i owns tokens query_start[i]:query_start[i+1]; these are the last
    query_lens[i] positions of its context of seq_lens[i] tokens (cached + new).
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset where each new token's K/V goes
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    query_lens: list[int]  # [B] new tokens per sequence this step
    seq_lens: list[int]  # [B] context length per sequence after this step
    query_start: list[int]  # [B + 1] cumulative offsets into the flat batch

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the batch."""
        return len(self.query_lens)


class AttentionBackend(Protocol):
    """Writes the step's K/V into the paged cache and computes attention for every query token."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Attend each query token over its own sequence's context (causal)."""
        ...
