"""Tiny random Hugging Face checkpoints (config.json + safetensors) for tests, built with transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = (
    "llama",
    "llama3",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "granite",
    "olmo2",
    "qwen3_moe",
    "mixtral",
)

_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_ARCH_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10000.0},
    "llama3": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "mistral": {"rope_theta": 10000.0, "sliding_window": None},
    "qwen2": {"rope_theta": 1000000.0, "use_sliding_window": False},
    "qwen3": {"rope_theta": 1000000.0, "head_dim": 32, "use_sliding_window": False},
    # small caps and window, so that soft-capping and the sliding layers change the logits of a 64-token prompt
    "gemma2": {
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 12,
        "attn_logit_softcapping": 1.0,
        "final_logit_softcapping": 2.0,
        "tie_word_embeddings": True,
    },
    # LongRoPE: the context (256) exceeds the original (32), so the long factors serve (models/rope.py)
    "phi3": {
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.0, 1.5, 2.2, 3.0, 4.5, 6.0, 9.0, 12.0],
            "original_max_position_embeddings": 32,
        },
        "original_max_position_embeddings": 32,  # transformers' Phi3Config puts its own into rope_parameters
        "sliding_window": None,
        "pad_token_id": 0,
    },
    "granite": {
        "rope_theta": 10000.0,
        "embedding_multiplier": 6.0,
        "attention_multiplier": 0.0625,
        "residual_multiplier": 0.3,
        "logits_scaling": 4.0,
    },
    "olmo2": {"rope_theta": 500000.0, "pad_token_id": 0},
    # eight experts, two per token; Qwen3-MoE's first layer dense (mlp_only_layers), its top-k weights renormalised
    "qwen3_moe": {
        "rope_theta": 1000000.0,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [0],
        "num_hidden_layers": 3,
        "use_sliding_window": False,
    },
    "mixtral": {"rope_theta": 1000000.0, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    # six layers: Gemma 3's default alternation (five sliding, one full)
    "gemma3": {
        "head_dim": 16,
        "num_hidden_layers": 6,
        "query_pre_attn_scalar": 24,
        "sliding_window": 12,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        },
    },
}


def make_tiny_checkpoint(arch: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a seeded random float32 checkpoint of `arch` (see ARCHITECTURES) into `path`; return `path`."""
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}")
    model_type = "llama" if arch == "llama3" else arch
    config_cls, model_cls = _classes(transformers, model_type)
    config = config_cls(**{**_COMMON, **_ARCH_OVERRIDES[arch], **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _randomize_norms(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _classes(transformers: Any, model_type: str) -> tuple[Any, Any]:
    """(Config class, ForCausalLM class) of a model type."""
    if model_type == "gemma3":
        return transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM
    prefixes = {
        "llama": "Llama",
        "mistral": "Mistral",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "gemma2": "Gemma2",
        "phi3": "Phi3",
        "granite": "Granite",
        "olmo2": "Olmo2",
        "qwen3_moe": "Qwen3Moe",
        "mixtral": "Mixtral",
    }
    prefix = prefixes[model_type]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")


def _randomize_norms(model: torch.nn.Module, seed: int) -> None:
    """Give norm weights and biases non-trivial values so that loading them wrongly shows in the logits."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
