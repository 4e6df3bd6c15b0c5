"""What a GGUF of one of Llama's variants (models/variants.py) keeps differently from a Llama GGUF: tensor names,
the convention of some values, and the metadata of the variants' config fields (llama.cpp's converter decides all
three)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from statelm.models.variant_config import FULL, GEMMA, SLIDING, gemma_layer_types, optional_float

# GGUF block tensor names -> Hugging Face names (relative to model.layers.N), where a variant's differ from Llama's
_GEMMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_NAMES = {
    "gemma2": _GEMMA_BLOCK_NAMES,
    "gemma3": _GEMMA_BLOCK_NAMES,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused: [q; k; v] and [gate; up]
    "olmo2": {
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# Tensors that hold config, not weights: LongRoPE's factors
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp keeps no query_pre_attn_scalar for Gemma: it uses hidden / heads for the 27B models, known by their
# layer count, and head_dim for the others
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


# A mixture of experts' router and stacked experts ([experts, rows, columns]; models/moe.py splits them)
_EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


def block_names(arch: str) -> dict[str, str]:
    """GGUF block tensor names of arch that map to other Hugging Face names than a Llama GGUF's."""
    return {**_EXPERT_NAMES, **_BLOCK_NAMES.get(arch, {})}


def to_hf_values(arch: str, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A float tensor's values as Hugging Face keeps them: llama.cpp stores Gemma's norm weights plus one."""
    if arch in GEMMA and hf_name.endswith("norm.weight"):
        return tensor - 1.0
    return tensor


def gguf_variant_fields(arch: str, key: Callable[..., Any], base: dict[str, Any]) -> dict[str, Any]:
    """Overrides of the Llama reading `base` of a GGUF's metadata; key(name) reads `{arch}.{name}` (None if absent)."""
    if arch == "phi3":
        return {"fused_projections": True}
    if arch == "granite":  # llama.cpp's names for Granite's multipliers
        return {
            "embedding_multiplier": float(key("embedding_scale") or 1.0),
            "attention_scale": optional_float(key("attention.scale")),
            "residual_multiplier": float(key("residual_scale") or 1.0),
            "logits_scaling": float(key("logit_scale") or 1.0),
        }
    if arch == "olmo2":
        return {"norm_layout": "post", "qk_norm": True, "qk_norm_full": True}
    if key("expert_count"):  # llama.cpp runs Mixtral as `llama` with experts; both normalise the top-k weights
        return {
            "architecture": "mixtral" if arch == "llama" else arch,
            "num_experts": int(key("expert_count")),
            "num_experts_per_tok": int(key("expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length") or base["intermediate_size"]),
            "norm_topk_prob": bool(key("expert_weights_norm", True)),
        }
    if arch not in GEMMA:
        return {}
    layers = base["num_hidden_layers"]
    heads, hidden = base["num_attention_heads"], base["hidden_size"]
    scalar = hidden / heads if layers == _GEMMA_27B_LAYERS[arch] else base["head_dim"]
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_tanh",
        "norm_layout": "sandwich",
        "attention_scale": float(key("attention.scale") or scalar**-0.5),
        "attn_logit_softcapping": optional_float(key("attn_logit_softcapping")),
        "final_logit_softcapping": optional_float(key("final_logit_softcapping")),
        "embedding_multiplier": hidden**0.5,
        "layer_types": tuple(_layer_types(arch, layers, key("attention.sliding_window_pattern"))),
    }
    if arch == "gemma3":
        fields |= {"qk_norm": True, "rope_local_theta": float(key("rope.freq_base_swa") or 10_000.0)}
    return fields


def _layer_types(arch: str, layers: int, pattern: Any) -> list[str]:
    """llama.cpp's sliding_window_pattern is an int (every how many layers is full) or a bool per layer."""
    if isinstance(pattern, list):
        return [SLIDING if sliding else FULL for sliding in pattern]
    return gemma_layer_types(arch, layers, {"sliding_window_pattern": pattern} if pattern else None)


def longrope_scaling(key: Callable[..., Any], factors: dict[str, np.ndarray]) -> dict[str, Any] | None:
    """LongRoPE's scaling from its factor tensors (by name, LONGROPE_TENSORS) and metadata, or None without them.

    llama.cpp's converter writes the attention factor transformers computes as `rope.scaling.attn_factor`.
    """
    if not factors:
        return None
    long, short = (factors[name].reshape(-1).tolist() for name in LONGROPE_TENSORS)
    scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": long, "short_factor": short}
    if key("rope.scaling.original_context_length"):
        scaling["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
    if key("rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(key("rope.scaling.attn_factor"))
    return scaling
