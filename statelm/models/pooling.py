"""Pooling of a prompt's final hidden states into one embedding: mean, last token or first (CLS) token."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from statelm.config import Pooling

__all__ = ["PooledRows", "Pooling", "pooled"]


def pooled(rows: torch.Tensor, pooling: Pooling, normalize: bool = True) -> torch.Tensor:
    """One float32 vector from a sequence's hidden states [T, H]: their mean, the last or the first row."""
    row = -1 if pooling is Pooling.LAST else 0
    vector = rows.float().mean(dim=0) if pooling is Pooling.MEAN else rows[row].float()
    return F.normalize(vector, dim=0) if normalize else vector


class PooledRows:
    """A prompt's hidden states as they come chunk by chunk, pooled when the last has come.

    Mean pooling keeps every row and sums them once at the end, so the result does not depend on how the prompt
    was split into chunks (nor so on what else ran in its steps).
    """

    def __init__(self, pooling: Pooling, num_tokens: int, normalize: bool = True) -> None:
        self.pooling = pooling
        self.num_tokens = num_tokens
        self.normalize = normalize
        self.rows: torch.Tensor | None = None  # [num_tokens, H] for mean, [1, H] otherwise

    def add(self, hidden: torch.Tensor, start: int) -> None:
        """Take the float states of prompt positions start..start+len(hidden)."""
        if self.rows is None:
            size = self.num_tokens if self.pooling is Pooling.MEAN else 1
            self.rows = torch.empty(size, hidden.shape[-1], dtype=torch.float32)
        end = start + hidden.shape[0]
        if self.pooling is Pooling.MEAN:
            self.rows[start:end] = hidden.float().cpu()
        elif self.pooling is Pooling.CLS and start == 0:
            self.rows[0] = hidden[0].float().cpu()
        elif self.pooling is Pooling.LAST and end == self.num_tokens:
            self.rows[0] = hidden[-1].float().cpu()

    def result(self) -> torch.Tensor:
        """The pooled vector (float32, unit length if normalize)."""
        assert self.rows is not None, "no hidden states were added"
        return pooled(self.rows, self.pooling if self.pooling is Pooling.MEAN else Pooling.CLS, self.normalize)
