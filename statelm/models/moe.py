"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a router picks the top-k experts of every token.

Batch invariance by construction: the router is a row-chunked linear and its softmax and top-k are per row; each
expert computes its tokens in calls of a fixed number of rows (the model's RowChunking size for generated rows, so
a row's result does not depend on how many other tokens chose the expert); and a token's experts are summed in
ascending expert order from zero. A token's output is therefore the same whatever else shares its batch.

The experts' weights are float (a GGUF's 3-D `ffn_*_exps` tensors are dequantized at load): statelm's packed
kernels take 2-D weights only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from statelm.models.config import ModelConfig
from statelm.models.layers import LayerOps, RowChunkedLinear, RowChunking, chunked_linear

if TYPE_CHECKING:
    from statelm.kernels.quant import PackedWeight

_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJECTIONS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class MoEMLP(nn.Module):
    """Top-k routed SwiGLU experts: `gate_up_proj` holds every expert's [gate; up] rows in turn (E * 2I rows),
    `down_proj` every expert's down rows (E * H rows), `router` the routing linear."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str, chunking: RowChunking
    ) -> None:
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        self.intermediate = config.moe_intermediate_size
        self.num_experts, self.top_k, self.normalize = experts, config.num_experts_per_tok, config.norm_topk_prob
        self.chunking = chunking
        linear = {"bias": False, "dtype": dtype, "device": device, "chunking": chunking}
        self.router = RowChunkedLinear(hidden, experts, **linear)
        self.gate_up_proj = RowChunkedLinear(hidden, experts * 2 * self.intermediate, **linear)
        self.down_proj = RowChunkedLinear(self.intermediate, experts * hidden, **linear)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """Each token [T, hidden] through its top-k experts, weighted by the router's (renormalised) probabilities."""
        probabilities = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, chosen = probabilities.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        rows, hidden, width = self.chunking.generated, x.shape[1], 2 * self.intermediate
        for expert in chosen.unique().tolist():  # ascending
            tokens, slot = torch.where(chosen == expert)
            gate_up = self.gate_up_proj.weight[expert * width : (expert + 1) * width]
            down = self.down_proj.weight[expert * hidden : (expert + 1) * hidden]
            h = ops.silu_mul(chunked_linear(x[tokens], gate_up, None, rows))
            y = chunked_linear(h, down, None, rows)
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out

    def targets(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        """Hugging Face names (relative to the layer's `mlp.`) of the router and the experts, and the rows they fill."""
        gate_up, down = self.gate_up_proj.weight, self.down_proj.weight
        size, hidden = self.intermediate, self.down_proj.out_features // self.num_experts
        targets = {"gate.weight": (self.router.weight, 0, self.num_experts)}
        for e in range(self.num_experts):
            start = e * 2 * size
            targets[f"experts.{e}.gate_proj.weight"] = (gate_up, start, start + size)
            targets[f"experts.{e}.up_proj.weight"] = (gate_up, start + size, start + 2 * size)
            targets[f"experts.{e}.down_proj.weight"] = (down, e * hidden, (e + 1) * hidden)
        return targets


def per_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor | PackedWeight]],
) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """Checkpoint weights with their experts named as Qwen3-MoE names them (`mlp.experts.E.gate_proj.weight`):
    Mixtral's `block_sparse_moe.experts.E.w1/w2/w3` renamed, a GGUF's stacked 3-D experts split per expert."""
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m[1]}.{_MIXTRAL_PROJECTIONS[m[2]]}.", name)
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 3:
            prefix, projection = name.rsplit(".experts.", 1)
            for expert in range(tensor.shape[0]):
                yield f"{prefix}.experts.{expert}.{projection}", tensor[expert]
        else:
            yield name, tensor


def is_moe_layer(config: ModelConfig, index: int) -> bool:
    """Whether layer index routes to experts (Qwen3-MoE may keep some layers dense)."""
    return config.num_experts > 0 and index not in config.dense_layers
