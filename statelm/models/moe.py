"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a router picks the top-k experts of every token.

Batch invariance by construction: the router is a row-chunked linear (on the kernels path float_linear, one dot
product an output in a fixed order) and its softmax and top-k are per row; each
expert computes its tokens either by statelm's packed kernel (which gives a row the same bits in any batch) or by
torch in calls of a fixed number of rows (the model's RowChunking size for generated rows), so a row's result does
not depend on how many other tokens chose the expert; and a token's experts are summed in ascending expert order
from zero. A token's output is therefore the same whatever else shares its batch.

Each expert's gate+up and down projections are linears of their own: float, or (a GGUF's expert stacks in a block
format, or --quantization int8/int4) PackedLinear layers over that expert's rows of the mapped blocks, swapped in
by install_packed like any packed linear. On the kernels path a packed expert multiplies its prompt rows and its
generated rows each in their --activations arithmetic, and a layer's chosen experts go to the kernel together, one
call per projection (kernel_matmuls: the same bits as one call each, with the threads shared over all of them, so
a decode step's eight small expert matmuls cost one call's overhead); on the torch paths it uses a dequantized copy.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from statelm.models.config import ModelConfig
from statelm.models.layers import LayerOps, RowChunkedLinear, RowChunking, chunked_linear
from statelm.models.packed import PackedLinear, kernel_matmuls

if TYPE_CHECKING:
    from statelm.kernels.quant import PackedWeight

_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJECTIONS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
_STACKED_EXPERTS = re.compile(r"\.experts\.(?!\d)")  # a GGUF's [experts, rows, columns] stack, not one expert
Rows = tuple[torch.Tensor | None, torch.Tensor | None]  # (prompt rows, generated rows), as RowChunking.rows_among


class Expert(nn.Module):
    """One expert's SwiGLU: `gate_up_proj` its [gate; up] rows, `down_proj` its down rows (float or packed)."""

    def __init__(self, hidden: int, intermediate: int, linear: dict[str, object]) -> None:
        super().__init__()
        self.gate_up_proj: RowChunkedLinear | PackedLinear = RowChunkedLinear(hidden, 2 * intermediate, **linear)
        self.down_proj: RowChunkedLinear | PackedLinear = RowChunkedLinear(intermediate, hidden, **linear)


class MoEMLP(nn.Module):
    """Top-k routed SwiGLU experts (`experts`, one Expert each) and the routing linear (`router`)."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str, chunking: RowChunking
    ) -> None:
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        self.intermediate = config.moe_intermediate_size
        self.num_experts, self.top_k, self.normalize = experts, config.num_experts_per_tok, config.norm_topk_prob
        self.chunking = chunking
        linear: dict[str, object] = {"bias": False, "dtype": dtype, "device": device, "chunking": chunking}
        self.router = RowChunkedLinear(hidden, experts, **linear)
        self.experts = nn.ModuleList(Expert(hidden, self.intermediate, linear) for _ in range(experts))

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """Each token [T, hidden] through its top-k experts, weighted by the router's (renormalised) probabilities."""
        if not x.shape[0]:
            return torch.zeros_like(x)
        probabilities = torch.softmax(ops.float_linear(self.router, x), dim=-1, dtype=torch.float32)
        weights, chosen = probabilities.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        chosen, order = chosen.sort(dim=-1)  # each token's experts ascending: the order its outputs are summed in
        weights = weights.gather(-1, order).to(x.dtype).flatten()
        picks = chosen.flatten().tolist()  # (token, slot) pairs' experts, token by token
        pairs = sorted(range(len(picks)), key=picks.__getitem__)  # by expert, then by token (a stable sort)
        experts = [(e, len(list(run))) for e, run in itertools.groupby(picks[p] for p in pairs)]
        sizes = [size for _, size in experts]
        pair_index = torch.tensor(pairs, dtype=torch.int64, device=x.device)
        tokens = pair_index.div(self.top_k, rounding_mode="floor")
        routes = [  # (expert, its rows' kinds among its tokens)
            (self.experts[e], self.chunking.rows_among(share))
            for (e, _), share in zip(experts, tokens.split(sizes), strict=True)
        ]
        gate_up = self._project(
            [(e.gate_up_proj, xs, r) for (e, r), xs in zip(routes, x[tokens].split(sizes), strict=True)]
        )
        hidden = ops.silu_mul(torch.cat(gate_up)).split(sizes)
        down = self._project([(e.down_proj, h, r) for (e, r), h in zip(routes, hidden, strict=True)])
        return ops.expert_sum(torch.cat(down).to(x.dtype), pair_index, weights, self.top_k)

    def _project(
        self, projections: list[tuple[RowChunkedLinear | PackedLinear, torch.Tensor, Rows]]
    ) -> list[torch.Tensor]:
        """Expert projections of their tokens' rows: all in one kernel call where every one is packed and on the
        kernel (rows: their kinds), else each by torch in calls of the fixed generated-row chunk size."""
        if all(isinstance(linear, PackedLinear) and linear.use_kernel for linear, _, _ in projections):
            return kernel_matmuls([(linear, x, *rows) for linear, x, rows in projections])
        return [
            chunked_linear(
                x,
                linear.dense(x.dtype) if isinstance(linear, PackedLinear) else linear.weight,
                None,
                self.chunking.generated,
            )
            for linear, x, _ in projections
        ]

    def targets(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        """Hugging Face names (relative to the layer's `mlp.`) of the router and the experts, and the rows they fill."""
        size = self.intermediate
        targets = {"gate.weight": (self.router.weight, 0, self.num_experts)}
        for e, expert in enumerate(self.experts):
            gate_up, down = expert.gate_up_proj.weight, expert.down_proj.weight
            targets[f"experts.{e}.gate_proj.weight"] = (gate_up, 0, size)
            targets[f"experts.{e}.up_proj.weight"] = (gate_up, size, 2 * size)
            targets[f"experts.{e}.down_proj.weight"] = (down, 0, down.shape[0])
        return targets

    def linear_groups(self, prefix: str) -> Iterator[tuple[nn.Module, str, list[str]]]:
        """The router and each expert's linears with the Hugging Face weights fused into them (see
        LlamaForCausalLM.linear_groups); prefix: the layer's `model.layers.N.mlp.`."""
        yield self, "router", [f"{prefix}gate.weight"]
        for e, expert in enumerate(self.experts):
            names = [f"{prefix}experts.{e}.{part}.weight" for part in ("gate_proj", "up_proj")]
            yield expert, "gate_up_proj", names
            yield expert, "down_proj", [f"{prefix}experts.{e}.down_proj.weight"]


def per_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor | PackedWeight]], experts: int
) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """Checkpoint weights with their experts named as Qwen3-MoE names them (`mlp.experts.E.gate_proj.weight`):
    Mixtral's `block_sparse_moe.experts.E.w1/w2/w3` renamed, a GGUF's stacked experts (3-D float, or packed blocks
    whose rows are every expert's in turn) split per expert."""
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m[1]}.{_MIXTRAL_PROJECTIONS[m[2]]}.", name)
        if not _STACKED_EXPERTS.search(name):
            yield name, tensor
            continue
        prefix, projection = name.rsplit(".experts.", 1)
        for expert in range(experts):
            if isinstance(tensor, torch.Tensor):
                part: torch.Tensor | PackedWeight = tensor[expert]
            else:
                rows = tensor.out_features // experts
                part = tensor.row_slice(expert * rows, (expert + 1) * rows)
            yield f"{prefix}.experts.{expert}.{projection}", part


def is_moe_layer(config: ModelConfig, index: int) -> bool:
    """Whether layer index routes to experts (Qwen3-MoE may keep some layers dense)."""
    return config.num_experts > 0 and index not in config.dense_layers
