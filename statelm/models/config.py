"""Architecture description of a decoder-only transformer, read from HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from statelm.models.rope import complete_rope_scaling
from statelm.models.variant_config import ModelConfigError, hf_variant_fields

SUPPORTED_ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "granite",
    "olmo2",
    "qwen3moe",
    "mixtral",
)
# Hugging Face model_type -> statelm architecture (llama.cpp's name), where the names differ
_MODEL_TYPES = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe"}


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder and its variants (models/variants.py: Gemma 2 and 3, ...).

    The fields after eos_token_ids are the variants' departures from Llama; their defaults are Llama's.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    rope_interleaved: bool = False  # q/k rows in llama.cpp's rotary order (adjacent pairs), as a GGUF stores them
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    hidden_activation: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_tanh (GeGLU)
    norm_layout: str = "pre"  # pre (Llama), sandwich (pre and post norms: Gemma 2/3), post (OLMo 2)
    attention_scale: float | None = None  # softmax scale of the scores; None: head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    embedding_multiplier: float = 1.0  # the embeddings are scaled by it (Gemma: sqrt(hidden))
    layer_types: tuple[str, ...] = ()  # SLIDING or FULL per layer (sliding_window applies to SLIDING ones); ()
    # means every layer attends as sliding_window says
    rope_local_theta: float | None = None  # rope base of the SLIDING layers (Gemma 3), without rope_scaling
    fused_projections: bool = False  # the checkpoint keeps qkv_proj and gate_up_proj fused (Phi-3)
    residual_multiplier: float = 1.0  # each block's attention and MLP outputs are scaled by it (Granite)
    logits_scaling: float = 1.0  # the logits are divided by it (Granite)
    qk_norm_full: bool = False  # qk_norm over all heads' q (and k) at once, not per head (OLMo 2)
    num_experts: int = 0  # mixture of experts (models/moe.py): experts per MoE layer, 0 for a dense model
    num_experts_per_tok: int = 0  # the top-k experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = True  # the top-k routing probabilities renormalised to sum to one
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP (intermediate_size) instead

    def __post_init__(self) -> None:
        for name in ("eos_token_ids", "layer_types", "dense_layers"):  # a config read back from JSON has lists
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` mapping."""
        model_type = str(raw.get("model_type", "")).lower()
        model_type = _MODEL_TYPES.get(model_type, model_type)
        if "text_config" in raw:
            kind = ", ".join(raw.get("architectures") or [model_type])
            raise ModelConfigError(
                f"{kind} is a multimodal checkpoint; statelm runs text decoders (for Gemma 3: a gemma3_text "
                "checkpoint, or the GGUF of its text model)"
            )
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r}; statelm runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
            values: dict[str, Any] = {
                "architecture": model_type,
                "vocab_size": int(raw["vocab_size"]),
                "hidden_size": hidden,
                "intermediate_size": int(raw["intermediate_size"]),
                "num_hidden_layers": int(raw["num_hidden_layers"]),
                "num_attention_heads": heads,
                "num_key_value_heads": int(raw.get("num_key_value_heads") or heads),
                "head_dim": int(raw.get("head_dim") or hidden // heads),
                "max_position_embeddings": int(raw.get("max_position_embeddings", 2048)),
                "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
                "rope_theta": float(_rope_theta(raw)),
                "rope_scaling": complete_rope_scaling(
                    _rope_scaling(raw), int(raw.get("max_position_embeddings", 2048))
                ),
                "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
                "attention_bias": bool(raw.get("attention_bias", model_type == "qwen2")),
                "qk_norm": model_type == "qwen3",
                "sliding_window": int(window) if window else None,
                "bos_token_id": raw.get("bos_token_id"),
                "eos_token_ids": eos_ids,
            }
            return cls(**{**values, **hf_variant_fields(model_type, raw, values)})
        except ModelConfigError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelConfigError(f"malformed config.json: {exc!r}") from exc

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping, used in the model fingerprint; a variant field at its default is left out, so that a
        Llama-family model's fingerprint (and its saved sessions) stay what they were before variants existed."""
        names = [f.name for f in fields(self)]
        variant = set(names[names.index("eos_token_ids") + 1 :])
        defaults = {f.name: f.default for f in fields(self)}
        return {n: getattr(self, n) for n in names if n not in variant or getattr(self, n) != defaults[n]}


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    return raw.get("rope_theta") or params.get("rope_theta") or 10000.0


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    scaling = dict(scaling, rope_type=kind)
    if raw.get("original_max_position_embeddings"):  # Phi-3 keeps it beside rope_scaling
        scaling.setdefault("original_max_position_embeddings", raw["original_max_position_embeddings"])
    return scaling
