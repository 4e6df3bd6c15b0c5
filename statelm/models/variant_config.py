"""The config fields by which Llama's variants depart from it, read from Hugging Face config.json or GGUF metadata.

Each reader returns keyword arguments of ModelConfig (config.py) that override the Llama-family reading of the same
source; an architecture without departures returns none.
"""

from __future__ import annotations

from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA = ("gemma2", "gemma3")
# every how many layers Gemma's full-attention layer comes (the others slide), when a config has no layer_types
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}


class ModelConfigError(ValueError):
    """A model configuration that statelm cannot run."""


def hf_variant_fields(model_type: str, raw: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Overrides of the Llama reading `base` of a config.json mapping `raw`, for model_type."""
    if model_type == "phi3":
        return _phi3_fields(raw)
    if model_type == "granite":
        return {
            "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
            "attention_scale": float(raw["attention_multiplier"]) if raw.get("attention_multiplier") else None,
            "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
            "logits_scaling": float(raw.get("logits_scaling", 1.0)),
        }
    if model_type == "olmo2":
        return {"norm_layout": "post", "qk_norm": True, "qk_norm_full": True}
    if model_type == "qwen3moe":
        step = int(raw.get("decoder_sparse_step") or 1)
        dense = set(raw.get("mlp_only_layers") or []) | {i for i in range(base["num_hidden_layers"]) if (i + 1) % step}
        return {
            "qk_norm": True,
            "num_experts": int(raw.get("num_experts") or raw["num_local_experts"]),  # transformers 5 saves the latter
            "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["moe_intermediate_size"]),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "dense_layers": tuple(sorted(dense)),
        }
    if model_type == "mixtral":
        return {
            "num_experts": int(raw["num_local_experts"]),
            "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": base["intermediate_size"],
        }
    if model_type not in GEMMA:
        return {}
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError(f"{model_type} with bidirectional attention is an encoder; statelm runs decoders")
    layers = base["num_hidden_layers"]
    fields: dict[str, Any] = {
        "hidden_activation": _activation(raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"),
        "norm_layout": "sandwich",
        "attention_scale": float(raw.get("query_pre_attn_scalar") or base["head_dim"]) ** -0.5,
        "attn_logit_softcapping": optional_float(raw.get("attn_logit_softcapping")),
        "final_logit_softcapping": optional_float(raw.get("final_logit_softcapping")),
        "embedding_multiplier": base["hidden_size"] ** 0.5,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "sliding_window": int(raw["sliding_window"]) if raw.get("sliding_window") else None,
        "layer_types": tuple(raw.get("layer_types") or gemma_layer_types(model_type, layers, raw)),
    }
    if model_type == "gemma3":
        params = raw.get("rope_parameters") or {}
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
        scaling = raw.get("rope_scaling") or full
        kind = scaling.get("rope_type") or scaling.get("type")
        fields |= {
            "qk_norm": True,
            "rope_theta": float(full.get("rope_theta") or raw.get("rope_theta") or 1_000_000.0),
            "rope_local_theta": float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10_000.0),
            "rope_scaling": None if kind in (None, "default") else dict(scaling, rope_type=kind),
        }
    return fields


def _phi3_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 and Phi-4: Llama with fused projections in the checkpoint and LongRoPE (models/rope.py)."""
    rotary = (raw.get("rope_parameters") or {}).get("partial_rotary_factor") or raw.get("partial_rotary_factor")
    if rotary not in (None, 1, 1.0):
        raise ModelConfigError(f"phi3 with partial_rotary_factor {rotary} (rope on part of each head) is not supported")
    return {"fused_projections": True}


def gemma_layer_types(model_type: str, layers: int, raw: dict[str, Any] | None = None) -> list[str]:
    """Gemma's alternation: a full-attention layer every `pattern` layers, the others sliding."""
    pattern = int((raw or {}).get("sliding_window_pattern") or _GEMMA_PATTERN[model_type])
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]


def _activation(name: str) -> str:
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    if name == "silu":
        return "silu"
    raise ModelConfigError(f"unsupported hidden activation {name!r}; statelm runs silu and gelu_pytorch_tanh")


def optional_float(value: Any) -> float | None:
    """None stays None; anything else becomes a float."""
    return None if value is None else float(value)
