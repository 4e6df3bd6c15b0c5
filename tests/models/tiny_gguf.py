"""Tiny GGUF models for tests: random Llama-family ones whose matrices are in one given block format, and ones
written from the tiny Hugging Face checkpoints (tiny_checkpoints.py) as llama.cpp's converter writes them (its
tensor names, its value conventions and its metadata keys, with gguf's writer)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from safetensors.numpy import load_file

from statelm.gguf_vocab import bytes_to_unicode
from tests.models.test_gguf import llama_cpp_permute, write_gguf
from tests.unit.gguf_blocks import random_blocks

SIZES = {"hidden": 256, "ffn": 512, "heads": 4, "kv_heads": 2, "layers": 2}
QUANTIZABLE = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1})  # gguf-py quantizes these; others: random blocks


def _matrix(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, Q | None]:
    if qtype == Q.F32:
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), None
    if qtype in QUANTIZABLE:
        return quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype), qtype
    return _random_blocks(qtype, rows, cols, rng), qtype


def _random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a [rows, cols] matrix in qtype, of weights near 0.05 in size."""
    # a K-quant's weight is d * sub-scale (up to 63) * level: small d keeps the weights near 0.05
    small = (2e-5, 1e-4) if GGML_QUANT_SIZES[qtype][0] == 256 else (0.002, 0.01)
    return random_blocks(qtype, rows, cols, rng, small)


def write_tiny_gguf(
    path: Path, qtype: Q, arch: str = "llama", seed: int = 0, formats: dict[str, Q] | None = None
) -> Path:
    """A 2-layer model (hidden 256, 4 heads of 64, 2 KV heads, FFN 512, tied embeddings) of the byte-level
    vocabulary of tests.models.test_gguf, with every matrix in qtype (or as `formats` says by tensor kind, e.g.
    {"attn_v": Q.Q6_K}, as llama-quantize's mixes do) and float32 norms."""
    formats = formats or {}
    rng = np.random.default_rng(seed)
    hidden, ffn, layers = SIZES["hidden"], SIZES["ffn"], SIZES["layers"]
    head_dim = hidden // SIZES["heads"]
    tensors = {
        "token_embd.weight": _matrix(formats.get("token_embd", qtype), 259, hidden, rng),
        "output_norm.weight": (np.ones(hidden, np.float32), None),
    }
    for i in range(layers):
        shapes = {
            "attn_q": (hidden, hidden),
            "attn_k": (SIZES["kv_heads"] * head_dim, hidden),
            "attn_v": (SIZES["kv_heads"] * head_dim, hidden),
            "attn_output": (hidden, hidden),
            "ffn_gate": (ffn, hidden),
            "ffn_up": (ffn, hidden),
            "ffn_down": (hidden, ffn),
        }
        for name, (rows, cols) in shapes.items():
            tensors[f"blk.{i}.{name}.weight"] = _matrix(formats.get(name, qtype), rows, cols, rng)
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = ((1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32), None)
    metadata = {
        "embedding_length": hidden,
        "feed_forward_length": ffn,
        "block_count": layers,
        "attention.head_count": SIZES["heads"],
        "attention.head_count_kv": SIZES["kv_heads"],
        "attention.layer_norm_rms_epsilon": 1e-5,
    }
    return write_gguf(path, tensors, arch=arch, metadata=metadata)


_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.router": "ffn_gate_inp",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
# llama.cpp's names where an architecture's blocks differ from Llama's
_ARCH_LAYER = {
    "gemma2": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}
_ARCH_LAYER["gemma3"] = _ARCH_LAYER["gemma2"]
_ARCH_LAYER["phi3"] = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_ARCH_LAYER["olmo2"] = {
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# Granite's multipliers: config.json's names, llama.cpp's keys
_GRANITE_KEYS = {
    "embedding_multiplier": "embedding_scale",
    "residual_multiplier": "residual_scale",
    "attention_multiplier": "attention.scale",
    "logits_scaling": "logit_scale",
}
_GGUF_ARCH = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "mixtral": "llama"}  # Mixtral is `llama` there
_EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_MIXTRAL_PARTS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def gguf_name(hf_name: str, arch: str) -> str:
    """llama.cpp's name of a Hugging Face tensor (or of a stacked expert tensor, already llama.cpp's)."""
    if hf_name.startswith("blk."):
        return hf_name
    module, kind = hf_name.rsplit(".", 1)
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{kind}"
    _, _, layer, part = module.split(".", 3)
    return f"blk.{layer}.{_ARCH_LAYER.get(arch, {}).get(part) or _LAYER[part]}.{kind}"


# A Gemma-style chat template (turns in <start_of_turn>/<end_of_turn>, the assistant is "model", no system role)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]


def gemma_style_vocab(writer: gguf.GGUFWriter) -> None:
    """A byte-level vocabulary with Gemma's control tokens and a Gemma-style chat template."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([*GEMMA_SPECIALS, *bytes_to_unicode().values()])
    writer.add_token_types([3] * len(GEMMA_SPECIALS) + [1] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(GEMMA_TEMPLATE)


def write_gguf_from_checkpoint(
    checkpoint: Path,
    path: Path,
    qtype: Q | None = None,
    tokenizer: Callable[[gguf.GGUFWriter], None] | None = None,
    experts: Q | None = None,
) -> Path:
    """Convert a tiny checkpoint to a GGUF (float32, or its matrices in qtype) with a tokenizer (default: the
    byte-level test vocabulary of test_gguf); experts: a mixture of experts' stacks in this format instead, random
    blocks where gguf-py cannot quantize to it (a K-quant)."""
    config = json.loads((checkpoint / "config.json").read_text())
    arch = _GGUF_ARCH.get(config["model_type"], config["model_type"])
    tensors: dict[str, tuple[np.ndarray, Q | None]] = {}
    rng = np.random.default_rng(0)
    for name, value in _stacked_experts(load_file(checkpoint / "model.safetensors")).items():
        value = _llama_cpp_values(name, value.astype(np.float32), arch, config)
        raw = experts if experts is not None and name.endswith("_exps.weight") else qtype
        if raw is None or value.ndim < 2:  # norms and float checkpoints stay float32
            tensors[gguf_name(name, arch)] = (value, None)
        elif raw in QUANTIZABLE:
            tensors[gguf_name(name, arch)] = (quantize(value, raw), raw)
        else:
            blocks = _random_blocks(raw, math.prod(value.shape[:-1]), value.shape[-1], rng)
            tensors[gguf_name(name, arch)] = (blocks.reshape(*value.shape[:-1], -1), raw)
    scaling = config.get("rope_parameters") or {}
    if scaling.get("rope_type") == "longrope":  # llama.cpp keeps LongRoPE's factors as tensors
        for kind in ("long", "short"):
            tensors[f"rope_factors_{kind}.weight"] = (np.asarray(scaling[f"{kind}_factor"], dtype=np.float32), None)
    extra = {} if tokenizer is None else {"tokenizer": tokenizer}
    return write_gguf(path, tensors, arch=arch, metadata=_metadata(arch, config), **extra)


def _stacked_experts(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert weights stacked into [experts, rows, columns] tensors, named as llama.cpp names them."""
    stacked: dict[str, dict[int, np.ndarray]] = {}
    out: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".experts." not in name:
            out[name.replace(".mlp.gate.", ".mlp.router.")] = value
            continue
        prefix, rest = name.split(".mlp.experts.")
        expert, part, _ = rest.split(".")
        layer = prefix.split(".")[2]
        stacked.setdefault(f"blk.{layer}.{_EXPERT_PARTS[_MIXTRAL_PARTS.get(part, part)]}.weight", {})[int(expert)] = (
            value
        )
    out |= {name: np.stack([experts[e] for e in sorted(experts)]) for name, experts in stacked.items()}
    return out


def _llama_cpp_values(name: str, value: np.ndarray, arch: str, config: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter does to a tensor's values: Gemma's norms plus one, Llama's Q/K rows permuted."""
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return value + 1.0
    if arch in ("llama", "mistral", "granite") and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
        return llama_cpp_permute(value, heads)
    return value


def _metadata(arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """The `{arch}.*` keys llama.cpp writes for config."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    params = config.get("rope_parameters") or {}
    metadata: dict[str, Any] = {
        "vocab_size": config["vocab_size"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "block_count": config["num_hidden_layers"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "context_length": config["max_position_embeddings"],
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "rope.freq_base": float((params.get("full_attention") or params).get("rope_theta") or 10000.0),
    }
    if config.get("sliding_window"):
        metadata["attention.sliding_window"] = config["sliding_window"]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            metadata[key] = float(config[key])
    if "sliding_attention" in params:
        metadata["rope.freq_base_swa"] = float(params["sliding_attention"]["rope_theta"])
    if arch == "granite":
        metadata |= {key: float(config[name]) for name, key in _GRANITE_KEYS.items()}
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        metadata |= {"expert_count": experts, "expert_used_count": config["num_experts_per_tok"]}
        if config.get("moe_intermediate_size"):
            metadata["expert_feed_forward_length"] = config["moe_intermediate_size"]
    kind = params.get("rope_type")
    if kind in ("yarn", "longrope"):
        original = params["original_max_position_embeddings"]
        metadata["rope.scaling.original_context_length"] = original
        factor = params.get("factor") or config["max_position_embeddings"] / original
    if kind == "yarn":
        metadata |= {"rope.scaling.type": "yarn", "rope.scaling.factor": float(factor)}
    if kind == "longrope":  # the converter writes the attention factor transformers would compute
        metadata["rope.scaling.attn_factor"] = (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        )
    return metadata
