"""The host memory a server may use, what its models take of it, and the start-up check of one against the other."""

from __future__ import annotations

import torch
from torch import nn

from statelm.kernels.quant import PackedWeight


class MemoryBudgetError(ValueError):
    """The models a server was asked to hold need more memory than it may use."""


def module_bytes(module: nn.Module) -> int:
    """Bytes a model's weights take: its parameters, buffers and packed quantized weights (a block matrix viewing a
    mapped file counts once: as its interleaved copy where one is made), shared storage once."""
    storages: dict[int, int] = {}
    for part in module.modules():
        tensors = [*part.parameters(recurse=False), *part.buffers(recurse=False)]
        for value in vars(part).values():
            if isinstance(value, PackedWeight):
                for matrix in value.parts:
                    if matrix.interleaved is not None:
                        tensors.append(matrix.interleaved)
                    if matrix.interleaved is None or not matrix.mapped:  # a mapped file's pages go once interleaved
                        tensors.append(matrix.data)
            elif isinstance(value, torch.Tensor):  # a dequantized copy kept beside a packed weight
                tensors.append(value)
        for tensor in tensors:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def check_memory(available: int, needs: list[tuple[str, int]]) -> None:
    """Raise MemoryBudgetError naming every need when together they are more than available."""
    total = sum(size for _, size in needs)
    if total <= available:
        return
    parts = ", ".join(f"{what} {_mib(size)}" for what, size in needs)
    raise MemoryBudgetError(
        f"not enough memory: {parts} need {_mib(total)} together, but this server may use {_mib(available)} "
        "(the memory available when it started); lower --kv-cache-memory or serve fewer or smaller models"
    )


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"
