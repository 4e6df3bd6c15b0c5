"""Linear and embedding layers whose weights stay in a packed quantized layout (GGUF blocks, int8, int4)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from statelm.models.layers import RowChunking

if TYPE_CHECKING:
    from statelm.kernels.quant import PackedWeight


class PackedLinear(nn.Module):
    """x @ W.T (+ bias) with W packed: statelm's kernel on the `kernels` path, a dequantized copy elsewhere.

    The dequantized copy is made only when a torch path is chosen (a CPU whose kernels fail the self-check,
    or a GPU), so the packed weight is all that memory holds on the fast path.
    """

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None, chunking: RowChunking) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.chunking = chunking
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.use_kernel = True
        self.int8_activations = False  # the kernel's arithmetic: float32 activations, or int8 as llama.cpp's
        self._dense: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the projection to [T, in_features]."""
        if self.use_kernel:
            out = self.weight.matmul(x, self.int8_activations)
            return out if self.bias is None else out + self.bias
        return self.chunking.linear(x, self.dense(x.dtype), self.bias)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [out, in], made on first use and kept."""
        if self._dense is None or self._dense.dtype != dtype:
            self._dense = self.weight.dequantize().to(dtype)
        return self._dense

    def use(self, kernel: bool) -> None:
        """Run through the kernel, or through torch on the dequantized weight (dropping it when not needed)."""
        self.use_kernel = kernel
        if kernel:
            self._dense = None

    def extra_repr(self) -> str:
        """Shape and packing, for print(model)."""
        shape = f"in={self.in_features}, out={self.out_features}, kind={self.weight.kind}"
        return f"{shape}, int8_activations={self.int8_activations}, bias={self.bias is not None}"


class PackedEmbedding(nn.Module):
    """Token embeddings read out of a packed weight (often shared with the LM head)."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the embedding matrix for ids [T], dequantized to float32."""
        return self.weight.embedding(ids)
