"""nomic-bert (nomic-embed-text's architecture) as nomic's published checkpoints describe and name it.

It is BERT's post-norm encoder with rotary positions instead of a position table, a SwiGLU feed-forward
(silu(fc12(x)) * fc11(x)), a fused Wqkv and no linear biases, so it runs on BertEncoder; this module reads its
config.json (GPT-2-style keys) and its tensor names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from statelm.models.bert import BertConfig, TensorNames
from statelm.models.config import ModelConfigError

MODEL_TYPE = "nomic_bert"
HF_ARCHITECTURE = "NomicBertModel"
HF_NAMES = TensorNames(
    layer_pattern=r"encoder\.layers\.(\d+)\.",
    top={
        "embeddings.word_embeddings": "word_embeddings",
        "embeddings.token_type_embeddings": "token_type_embeddings",
        "emb_ln": "embedding_norm",
    },
    layer={
        "attn.Wqkv": "qkv",
        "attn.out_proj": "attn_out",
        "norm1": "attn_norm",
        "mlp.fc11": "up",
        "mlp.fc12": "gate",
        "mlp.fc2": "down",
        "norm2": "out_norm",
    },
)
# What statelm runs, with the published NomicBertConfig's default for a key a config.json leaves out
_REQUIRED = {
    "activation_function": ("swiglu", "gelu_new"),
    "prenorm": (False, False),
    "parallel_block": (False, False),
    "rotary_emb_fraction": (1.0, 0.0),
    "rotary_emb_interleaved": (False, False),
    "rotary_emb_scale_base": (None, None),
    "use_rms_norm": (False, False),
    "causal": (False, False),
    "moe_every_n_layers": (None, None),
}
_BIASES = ("qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias")  # each True by default


def is_nomic_bert(config: Mapping[str, Any]) -> bool:
    """True for a config.json of nomic-bert."""
    return config.get("model_type") == MODEL_TYPE or HF_ARCHITECTURE in (config.get("architectures") or [])


def config_from_hf(config: Mapping[str, Any]) -> BertConfig:
    """The encoder's shape from a nomic-bert config.json.

    The context is `max_trained_positions` where it is shorter than `n_positions` (nomic-embed-text v1 and v1.5
    declare 8192 but are trained on 2048, as llama.cpp's converter also reads them); within it, the optional
    dynamic-NTK `rotary_scaling_factor` changes nothing, as it only acts beyond it.
    """
    for key, (required, default) in _REQUIRED.items():
        if config.get(key, default) != required:
            raise ModelConfigError(f"nomic-bert with {key}={config.get(key, default)!r} is not supported")
    biases = {bool(config.get(key, True)) for key in _BIASES}
    if len(biases) > 1:
        raise ModelConfigError("nomic-bert with biases on some linears only is not supported")
    if config.get("n_inner") is None:
        raise ModelConfigError("nomic-bert config.json has no n_inner")
    positions = int(config["n_positions"])
    return BertConfig(
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["n_embd"]),
        num_hidden_layers=int(config["n_layer"]),
        num_attention_heads=int(config["n_head"]),
        intermediate_size=int(config["n_inner"]),
        max_position_embeddings=min(positions, int(config.get("max_trained_positions") or positions)),
        type_vocab_size=int(config.get("type_vocab_size", 2)),
        layer_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        rope_theta=float(config.get("rotary_emb_base", 10000.0)),
        gated_mlp=True,
        linear_bias=biases.pop(),
    )
