"""Every decoder layer of a packed model in one C++ call: the Python forward's kernel calls, without the Python."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from statelm.models.packed import PackedLinear

if TYPE_CHECKING:
    from statelm.attention.base import AttentionMetadata, KVView
    from statelm.models.layers import RopeInputs
    from statelm.models.llama import LlamaForCausalLM


class FusedDecoder:
    """torch.ops.statelm.decoder_layers over a model whose linears are all packed, on the kernels path.

    The op makes the same kernel calls as LlamaForCausalLM.forward on the kernels path, in the same order, so its
    hidden states are the same bit for bit; it only serves forwards whose rows all take one kind of activations
    (every step under `float32` or `int8`; under `int8-decode`, steps of prompt rows only or generated rows only).
    """

    def __init__(self, model: LlamaForCausalLM, weights: list[torch.Tensor | None], dims: list[int]) -> None:
        self.model = model
        self.weights = weights
        self.dims = dims
        self.eps = model.config.rms_norm_eps
        self.scale = model.config.head_dim**-0.5

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> FusedDecoder | None:
        """The fused decoder of a model, or None when a linear of it is not packed."""
        weights: list[torch.Tensor | None] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(linear, PackedLinear) for linear in linears):
                return None
            qkv, o, gate_up, down = linears
            weights += [layer.input_layernorm.weight, *_packed(qkv), qkv.bias, *_packed(o), o.bias]
            weights += [layer.post_attention_layernorm.weight, *_packed(gate_up), *_packed(down)]
            norms = attn.q_norm, attn.k_norm
            weights += [None, None] if None in norms else [norm.weight for norm in norms]  # type: ignore[union-attr]
        first = model.layers[0]
        attn, mlp = first.self_attn, first.mlp
        dims = [
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            attn.qkv_proj.out_features,
            attn.o_proj.out_features,
            mlp.gate_up_proj.out_features,
            mlp.down_proj.out_features,
            model.config.sliding_window or 0,
        ]
        return cls(model, weights, dims)

    def __call__(
        self, x: torch.Tensor, rope: RopeInputs, kv_cache: KVView, meta: AttentionMetadata, int8: bool
    ) -> torch.Tensor:
        """Hidden states after the final norm, from the embeddings x [T, hidden]."""
        return torch.ops.statelm.decoder_layers(
            x,
            rope.positions,
            rope.table,
            self.weights,
            kv_cache.k,
            kv_cache.v,
            kv_cache.k_scale,
            kv_cache.v_scale,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens_tensor,
            meta.query_start_tensor,
            self.model.norm.weight,
            self.dims,
            self.eps,
            self.scale,
            int8,
        )


def _packed(linear: PackedLinear) -> list[torch.Tensor | None]:
    """A packed linear's values, scales and mins (None for q8)."""
    weight = linear.weight
    return [weight.values, weight.scales, weight.mins]
