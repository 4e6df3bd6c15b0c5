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
        # the kernel's arithmetic: float32 activations, int8 as llama.cpp's, or int8-decode (int8 for generated
        # tokens' rows, float32 for prompt rows: a row's kind never depends on its batch, see RowChunking)
        self.activations = "float32"
        self._dense: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the projection to [T, in_features]."""
        if self.use_kernel:
            out = self._kernel_matmul(x)
            return out if self.bias is None else out + self.bias
        return self.chunking.linear(x, self.dense(x.dtype), self.bias)

    def _kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The packed matmul with each row's activations as the setting and the row's kind say."""
        if self.activations != "int8-decode":
            return self.weight.matmul(x, self.activations == "int8")
        prompt, generated = self.chunking.prompt_rows, self.chunking.generated_rows
        if prompt is None or generated is None:
            return self.weight.matmul(x, prompt is None)  # all rows of one kind
        out = x.new_empty(x.shape[0], self.out_features, dtype=torch.float32)
        out[generated] = self.weight.matmul(x[generated], True)
        out[prompt] = self.weight.matmul(x[prompt], False)
        return out

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
        return f"{shape}, activations={self.activations}, bias={self.bias is not None}"


class PackedEmbedding(nn.Module):
    """Token embeddings read out of a packed weight (often shared with the LM head)."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the embedding matrix for ids [T], dequantized to float32."""
        return self.weight.embedding(ids)
