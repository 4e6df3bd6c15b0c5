"""Every decoder layer of a packed model in one C++ call: the Python forward's kernel calls, without the Python.

Llama's block, its MLPs dense or mixtures of experts (models/moe.py: the op routes each layer's tokens as MoEMLP does,
with the same calls), and the variants' blocks the op takes (models/variants.py, `fusable`): Gemma 2 and 3's norms
after attention and MLP, OLMo 2's after them only, GeGLU, soft-capped scores and sliding layers with their own rope,
Granite's multipliers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from statelm.kernels.quant import ARITHMETICS
from statelm.models.layers import kernel_float_linear
from statelm.models.moe import MoEMLP
from statelm.models.packed import PackedLinear
from statelm.models.variant_config import SLIDING

if TYPE_CHECKING:
    from statelm.attention.base import AttentionMetadata, KVView
    from statelm.models.layers import RopeInputs
    from statelm.models.llama import LlamaForCausalLM


_LAYOUTS = {"pre": 0, "sandwich": 1, "post": 2}  # decoder.cpp's Layout


class FusedDecoder:
    """torch.ops.statelm.decoder_layers over a model whose linears are all packed, on the kernels path.

    The op makes the same kernel calls as LlamaForCausalLM.forward on the kernels path (and as MoEMLP.forward for a
    mixture of experts), in the same order, so its hidden states are the same bit for bit; it only serves forwards
    whose rows all take one arithmetic (every step under `float32` or `int8`; under `int8-decode` or `int16-prompt`,
    steps of prompt rows only or generated rows only). The layers' weights and settings are handed to C++ once, as a
    torch.classes.statelm.PreparedLayers, so that a step converts only what changes (a mixture of experts has
    thousands of block matrices).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        tensors: list[torch.Tensor | None],
        blocks: list[torch.Tensor],
        block_types: list[int],
        parts: list[int],
        experts: list[int],
    ) -> None:
        config = model.config
        # per layer: 1 where it attends as a sliding layer (a variant's local backend and rope), else 0
        layer_kinds = [int(getattr(layer, "kind", None) == SLIDING) for layer in model.layers]
        full, sliding = model.backend, getattr(model, "local_backend", model.backend)
        windows = [backend.sliding_window or 0 for backend in (full, sliding)]  # type: ignore[attr-defined]
        (layout,) = {getattr(layer, "layout", "pre") for layer in model.layers}  # a config field: one for all
        activations = {getattr(layer.mlp, "activation", "silu") for layer in model.layers}
        dims = [
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            *windows,
            config.num_experts_per_tok,
            int(config.norm_topk_prob),
            _LAYOUTS[layout],
            int(activations == {"gelu_tanh"}),
        ]
        # the layers' weights and settings, converted once (the op's per-step arguments are only what changes)
        self.layers = torch.classes.statelm.PreparedLayers(
            tensors,
            blocks,
            block_types,
            parts,
            model.norm.weight,
            dims,
            experts,  # per layer: 0 for a dense MLP, else its mixture's experts
            layer_kinds,
            config.rms_norm_eps,
            model.layers[0].self_attn.scale,
            config.attn_logit_softcapping or 0.0,
            config.residual_multiplier,
        )

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> FusedDecoder | None:
        """The fused decoder of a model, or None when a linear of it is not packed (a float32 router aside) or a
        router has a bias. The model's blocks are Llama's or a variant's that `fusable` admits."""
        tensors: list[torch.Tensor | None] = []
        blocks: list[torch.Tensor] = []
        block_types: list[int] = []
        parts: list[int] = []
        experts: list[int] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            router: torch.Tensor | None = None
            if isinstance(mlp, MoEMLP):  # routed as KernelLayerOps routes: float_linear, or the packed router
                if mlp.router.bias is not None:
                    return None
                router = mlp.router.weight if kernel_float_linear(mlp.router) else None
                mlp_linears = [] if router is not None else [mlp.router]
                mlp_linears += [linear for expert in mlp.experts for linear in (expert.gate_up_proj, expert.down_proj)]
                experts.append(mlp.num_experts)
            else:
                mlp_linears = [mlp.gate_up_proj, mlp.down_proj]
                experts.append(0)
            linears = (attn.qkv_proj, attn.o_proj, *mlp_linears)
            if not all(isinstance(linear, PackedLinear) for linear in linears):
                return None
            for linear in linears:
                data, types = linear.weight.kernel_arguments()
                blocks += data
                block_types += types
                parts.append(len(data))
            qkv, o = attn.qkv_proj, attn.o_proj
            tensors += [layer.input_layernorm.weight, qkv.bias, o.bias, layer.post_attention_layernorm.weight]
            norms = attn.q_norm, attn.k_norm
            tensors += [None, None] if None in norms else [norm.weight for norm in norms]  # type: ignore[union-attr]
            tensors.append(router)
            feedforward = [
                getattr(layer, name, None) for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
            ]
            tensors += [None if norm is None else norm.weight for norm in feedforward]
        return cls(model, tensors, blocks, block_types, parts, experts)

    def __call__(
        self,
        x: torch.Tensor,
        rope: RopeInputs,
        kv_cache: KVView,
        meta: AttentionMetadata,
        arithmetic: str,
        local_rope: RopeInputs | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, from the embeddings x [T, hidden] (sliding layers rotate by
        local_rope where given)."""
        return torch.ops.statelm.decoder_layers(
            self.layers,
            x,
            rope.positions,
            rope.table,
            None if local_rope is None else local_rope.table,
            kv_cache.k,
            kv_cache.v,
            kv_cache.k_scale,
            kv_cache.v_scale,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens_tensor,
            meta.query_start_tensor,
            ARITHMETICS[arithmetic],
            rope.interleaved,
        )
