"""Llama's variants (Gemma 2, Gemma 3) match transformers' logits on the same weights: from the Hugging Face
checkpoint and from a GGUF of it, over a shuffled paged KV cache, a prompt and then decode steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from statelm.kernels.build import kernels_available
from statelm.models.compute_path import use_compute_path
from statelm.models.config import ModelConfig, ModelConfigError
from statelm.models.gguf import load_gguf
from statelm.models.llama import LlamaForCausalLM
from statelm.models.variant_config import FULL, SLIDING
from statelm.models.variants import VariantForCausalLM, model_class
from tests.models.test_hf_parity import DECODE_STEPS, PROMPT_LEN, PagedSequences, hf_logits, random_tokens
from tests.models.tiny_checkpoints import make_tiny_checkpoint
from tests.models.tiny_gguf import write_gguf_from_checkpoint

pytest.importorskip("transformers")

TOLERANCE = 1e-4
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("gemma2", {}),
    "gemma2-untied": ("gemma2", {"tie_word_embeddings": False}),
    "gemma3": ("gemma3", {}),
    "gemma3-linear-rope": (
        "gemma3",
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            }
        },
    ),
    "phi3-longrope-long": ("phi3", {}),
    "phi3-longrope-short": ("phi3", {"original_max_position_embeddings": 256}),
    "granite": ("granite", {}),
    "olmo2": ("olmo2", {}),
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-unnormalised": ("qwen3_moe", {"norm_topk_prob": False}),
    "mixtral": ("mixtral", {}),
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e6}
# llama.cpp keeps no query_pre_attn_scalar: a GGUF of a Gemma whose scalar is not head_dim scales by head_dim
GGUF_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}),
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 16}),
    "phi3-longrope": ("phi3", {}),
    "qwen2-yarn": ("qwen2", {"rope_parameters": YARN}),
    "granite": ("granite", {}),
    "olmo2": ("olmo2", {}),
    "qwen3-moe": ("qwen3_moe", {"mlp_only_layers": []}),  # llama.cpp's qwen3moe has experts in every layer
    "mixtral": ("mixtral", {}),
}


def build(config: ModelConfig, weights: Any) -> LlamaForCausalLM:
    """The statelm model of config with the given (name, tensor) weights."""
    model = model_class(config)(config)
    model.load_weights(weights)
    return model


def prefill_then_decode(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """Logits of every position: tokens[:PROMPT_LEN] in one step, then one token per step."""
    runner = PagedSequences(model)
    outputs = [runner.step({0: tokens[:PROMPT_LEN]})[0]]
    outputs += [runner.step({0: [token]})[0] for token in tokens[PROMPT_LEN:]]
    return torch.cat(outputs)


def assert_matches_transformers(model: LlamaForCausalLM, checkpoint: Path) -> None:
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, model.config.vocab_size, seed=1)
    ours = prefill_then_decode(model, tokens)
    expected = hf_logits(checkpoint, tokens)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_checkpoint_matches_transformers(variant: str, tmp_path: Path) -> None:
    arch, overrides = VARIANTS[variant]
    path = make_tiny_checkpoint(arch, tmp_path, **overrides)
    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    assert config.architecture == arch.replace("_", "")
    model = build(config, load_file(path / "model.safetensors").items())
    assert_matches_transformers(model, path)


@pytest.mark.parametrize("variant", list(GGUF_VARIANTS))
def test_gguf_matches_transformers(variant: str, tmp_path: Path) -> None:
    arch, overrides = GGUF_VARIANTS[variant]
    checkpoint = make_tiny_checkpoint(arch, tmp_path / "hf", **overrides)
    gguf = load_gguf(write_gguf_from_checkpoint(checkpoint, tmp_path / f"{arch}.gguf"))
    hf_config = ModelConfig.from_hf_dict(json.loads((checkpoint / "config.json").read_text()))
    same = ("layer_types", "attention_scale", "sliding_window", "rope_local_theta", "embedding_multiplier", "qk_norm")
    assert {name: getattr(gguf.config, name) for name in same} == {name: getattr(hf_config, name) for name in same}
    assert (gguf.config.rope_scaling or {}).get("rope_type") == (hf_config.rope_scaling or {}).get("rope_type")
    assert_matches_transformers(build(gguf.config, gguf.tensors()), checkpoint)


@pytest.mark.skipif(not kernels_available(), reason="statelm's C++ kernels are not built here")
def test_gemma2_on_the_kernels_path_matches_transformers(tmp_path: Path) -> None:
    """Soft-capped scores (a cap of 1: every score bent) by the paged attention kernel, sliding and full layers."""
    path = make_tiny_checkpoint("gemma2", tmp_path)
    model = build(
        ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text())),
        load_file(path / "model.safetensors").items(),
    )
    use_compute_path(model, "kernels")
    assert_matches_transformers(model, path)


def test_gemma_layer_types() -> None:
    config = ModelConfig.from_hf_dict(
        {"model_type": "gemma3_text", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
         "num_hidden_layers": 12, "num_attention_heads": 2, "sliding_window": 4}
    )  # fmt: skip
    assert config.layer_types == tuple(FULL if i in (5, 11) else SLIDING for i in range(12))
    assert config.attention_scale == 4**-0.5 and config.rope_local_theta == 10000.0 and config.tie_word_embeddings


def test_each_fast_path_a_variant_cannot_run_is_named() -> None:
    sizes = {
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    capped = VariantForCausalLM(
        ModelConfig.from_hf_dict({"model_type": "gemma2", "attn_logit_softcapping": 50.0, **sizes})
    )
    assert capped.unsupported_paths() == {}  # soft-capping: in the CPU and the Triton attention kernels
    moe = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, **sizes}
    assert set(VariantForCausalLM(ModelConfig.from_hf_dict(moe)).unsupported_paths()) == {"triton"}
    assert (
        VariantForCausalLM(ModelConfig.from_hf_dict({"model_type": "gemma3_text", **sizes})).unsupported_paths() == {}
    )


def test_a_multimodal_gemma3_checkpoint_is_refused_clearly() -> None:
    raw = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": {}}
    with pytest.raises(ModelConfigError, match="Gemma3ForConditionalGeneration is a multimodal checkpoint"):
        ModelConfig.from_hf_dict(raw)
