"""Linear and embedding layers whose weights stay in GGUF block formats (read in place, or quantized at load)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from statelm.kernels.quant import matmul_groups
from statelm.models.layers import RowChunking

if TYPE_CHECKING:
    from statelm.kernels.quant import PackedWeight

# --activations: the kernel's arithmetic for (prompt rows, generated rows). A row's kind never depends on its batch
# (see RowChunking), so neither does its arithmetic.
ACTIVATIONS = {
    "float32": ("float32", "float32"),
    "int8": ("int8", "int8"),
    "int8-decode": ("float32", "int8"),
    "int16-prompt": ("int16", "int8"),
}


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
        self.activations = "float32"  # a key of ACTIVATIONS
        self.repack = True  # interleave the blocks for the kernel (--repack)
        self._dense: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the projection to [T, in_features]."""
        if self.use_kernel:
            out = self.kernel_matmul(x, self.chunking.prompt_rows, self.chunking.generated_rows)
            return out if self.bias is None else out + self.bias
        return self.chunking.linear(x, self.dense(x.dtype), self.bias)

    def kernel_matmul(
        self, x: torch.Tensor, prompt: torch.Tensor | None, generated: torch.Tensor | None
    ) -> torch.Tensor:
        """x @ W.T [T, out] float32 by the kernel (no bias), each row in its kind's arithmetic: prompt and generated
        index x's rows as RowChunking's prompt_rows and generated_rows index a batch (None: see split_rows)."""
        return kernel_matmuls([(self, x, prompt, generated)])[0]

    def kernel_calls(
        self, x: torch.Tensor, prompt: torch.Tensor | None, generated: torch.Tensor | None
    ) -> list[tuple[torch.Tensor | None, torch.Tensor, str]]:
        """kernel_matmul's kernel calls: (the rows of x a call computes, None for all of them; those rows; its
        arithmetic)."""
        prompt_arithmetic, generated_arithmetic = ACTIVATIONS[self.activations]
        if prompt is None or generated is None or prompt_arithmetic == generated_arithmetic:
            return [(None, x, generated_arithmetic if prompt is None else prompt_arithmetic)]
        return [(generated, x[generated], generated_arithmetic), (prompt, x[prompt], prompt_arithmetic)]

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [out, in], made on first use and kept."""
        if self._dense is None or self._dense.dtype != dtype:
            self._dense = self.weight.dequantize().to(dtype)
        return self._dense

    def use(self, kernel: bool) -> None:
        """Run through the kernel (on the interleaved blocks where `repack`), or through torch on the dequantized
        weight; each drops what the other needed."""
        self.use_kernel = kernel
        if kernel:
            self._dense = None
        self.weight = self.weight.interleave() if kernel and self.repack else self.weight.in_place()

    def extra_repr(self) -> str:
        """Shape and formats, for print(model)."""
        shape = f"in={self.in_features}, out={self.out_features}, formats={self.weight.kind}"
        return f"{shape}, activations={self.activations}, bias={self.bias is not None}"


def kernel_matmuls(
    projections: Sequence[tuple[PackedLinear, torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
) -> list[torch.Tensor]:
    """PackedLinear.kernel_matmul of each (linear, x, prompt, generated), all in one kernel call (matmul_groups):
    the same bits as one by one, with the threads shared out over every projection's tiles at once."""
    calls = [(linear, x, linear.kernel_calls(x, prompt, generated)) for linear, x, prompt, generated in projections]
    results = iter(matmul_groups([(rows, linear.weight, how) for linear, _, parts in calls for _, rows, how in parts]))
    outputs = []
    for linear, x, parts in calls:
        if parts[0][0] is None:
            outputs.append(next(results))
            continue
        out = x.new_empty(x.shape[0], linear.out_features, dtype=torch.float32)
        for rows, _, _ in parts:
            out[rows] = next(results)
        outputs.append(out)
    return outputs


class PackedEmbedding(nn.Module):
    """Token embeddings read out of a packed weight, or out of the LM head's that it is tied to.

    Tied, the lookups read whatever the head reads (its interleaved copy once made, whose file pages are then handed
    back): reading the file's rows instead would bring every new token's page back from the disk, and the rows into
    resident memory a second time.
    """

    def __init__(self, weight: PackedWeight, tied_head: PackedLinear | None = None) -> None:
        super().__init__()
        self._own = weight
        self._tied = (tied_head,)  # in a tuple: not registered as a second owner of the head's module

    @property
    def weight(self) -> PackedWeight:
        """The packed weight the lookups read."""
        head = self._tied[0]
        return self._own if head is None else head.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the embedding matrix for ids [T], dequantized to float32."""
        return self.weight.embedding(ids)
