"""Decoders that depart from Llama inside the block or its checkpoint: Gemma 2 and 3 (text), Phi-3/Phi-4, Granite 3,
OLMo 2, and the mixtures of experts Qwen3-MoE and Mixtral (models/moe.py).

Their departures are config fields (config.py, read by variant_config.py): pre and post norms around attention and
MLP ("sandwich"), GeGLU, a softmax scale of their own, soft-capped attention scores and logits, scaled embeddings,
layers that alternate between a sliding window (with their own rope base) and full attention, and checkpoints that
keep the QKV and gate/up projections fused (Phi-3, which statelm fuses the same way). The model keeps
Llama's parts and weight names (llama.py), so the loaders, the packed weights and the compute-path pass take it as
they take Llama; what the fast paths cannot run is said by `unsupported_paths`, and `fusable` says whether the fused
decoder runs its layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from typing import TYPE_CHECKING

import torch
from torch import nn

from statelm.attention.base import AttentionBackend, AttentionMetadata, KVView
from statelm.attention.layer_kv import LayerKV
from statelm.attention.reference import TorchAttentionBackend
from statelm.models.config import ModelConfig
from statelm.models.layers import GatedMLP, LayerOps, RMSNorm, RotaryEmbedding, RowChunking
from statelm.models.llama import ForwardStep, LlamaDecoderLayer, LlamaForCausalLM, _whole
from statelm.models.moe import MoEMLP, is_moe_layer, per_expert_weights
from statelm.models.variant_config import FULL, GEMMA, SLIDING

if TYPE_CHECKING:
    from statelm.kernels.quant import PackedWeight

VARIANT_ARCHITECTURES = frozenset({*GEMMA, "phi3", "granite", "olmo2", "qwen3moe", "mixtral"})
# the Hugging Face weights of a checkpoint with fused projections, by the linear they fill
_FUSED = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "gate_up_proj": ("mlp", ("gate_proj", "up_proj"))}


# The config fields of a mixture of experts
_EXPERT_FIELDS = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "dense_layers"}
# The departures the fused decoder takes (models/fused_decoder.py): a model departing from Llama only in them runs all
# its layers in one call. Logits and embeddings stay in Python.
_FUSABLE_FIELDS = _EXPERT_FIELDS | {
    "attention_scale",
    "attn_logit_softcapping",
    "embedding_multiplier",
    "final_logit_softcapping",
    "hidden_activation",
    "layer_types",
    "logits_scaling",
    "norm_layout",
    "qk_norm_full",
    "residual_multiplier",
    "rope_local_theta",
}


class VariantMLP(GatedMLP):
    """Gated MLP with the config's activation: SwiGLU (silu) or GeGLU (gelu, tanh approximation)."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str, chunking: RowChunking
    ) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, dtype=dtype, device=device, chunking=chunking)
        self.activation = config.hidden_activation

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """Apply the feed-forward block to [T, hidden]."""
        gate_up = self.gate_up_proj(x)
        hidden = ops.gelu_tanh_mul(gate_up) if self.activation == "gelu_tanh" else ops.silu_mul(gate_up)
        return self.down_proj(hidden)


class VariantDecoderLayer(LlamaDecoderLayer):
    """A decoder block in the config's norm layout, attending as its layer type (sliding or full) says.

    Layouts: `pre` (Llama's, with Granite's residual multiplier), `sandwich` (Gemma: norms before and after attention
    and MLP), `post` (OLMo 2: norms after attention and MLP only). Module names are Hugging Face's: outside the pre
    layout `post_attention_layernorm` normalises the attention's output, and `pre_feedforward_layernorm` the MLP's
    input (the pre layout's `post_attention_layernorm`).
    """

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        chunking: RowChunking,
    ) -> None:
        super().__init__(config, dtype=dtype, device=device, chunking=chunking)
        mlp = MoEMLP if is_moe_layer(config, index) else VariantMLP
        self.mlp: VariantMLP | MoEMLP = mlp(config, dtype=dtype, device=device, chunking=chunking)
        self.kind = layer_kind(config, index)
        self.layout = config.norm_layout
        self.residual_multiplier = config.residual_multiplier  # of the pre layout (Granite); 1 for the others
        norm = {"eps": config.rms_norm_eps, "dtype": dtype, "device": device}
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, **norm)
        if self.layout != "pre":
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, **norm)

    def extra_norms(self) -> dict[str, RMSNorm]:
        """The norms Llama's block does not have, by Hugging Face name relative to the layer."""
        names = {
            "pre": [],
            "sandwich": ["pre_feedforward_layernorm", "post_feedforward_layernorm"],
            "post": ["post_feedforward_layernorm"],
        }[self.layout]
        return {name: getattr(self, name) for name in names}

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cache: LayerKV,
        step: ForwardStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the block on [T, hidden] as LlamaDecoderLayer does: returns its output and the residual stream."""
        ops = step.ops
        if self.layout == "post":  # no norm before attention (OLMo 2)
            residual = x if residual is None else residual.add_(x)
            h = residual
        elif residual is None:
            norm = self.input_layernorm
            residual, h = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            norm = self.input_layernorm
            h = ops.add_rms_norm(residual, x, norm.weight, norm.eps)
        attention = self.self_attn(h, cache, step)
        norm = self.post_attention_layernorm  # the pre layout's norm before the MLP, the others' after attention
        if self.layout == "pre":
            h = ops.add_rms_norm(residual, self._scaled(attention), norm.weight, norm.eps)
            return self._scaled(self.mlp(h, ops)), residual
        attention = ops.rms_norm(attention, norm.weight, norm.eps)
        if self.layout == "sandwich":
            norm = self.pre_feedforward_layernorm
            h = ops.add_rms_norm(residual, attention, norm.weight, norm.eps)
        else:
            h = residual.add_(attention)
        norm = self.post_feedforward_layernorm
        return ops.rms_norm(self.mlp(h, ops), norm.weight, norm.eps), residual

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """A block output as it joins the residual stream (Granite scales it)."""
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class VariantForCausalLM(LlamaForCausalLM):
    """A Llama-family model whose blocks, embeddings, attention and logits follow the config's departures."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        chunking: RowChunking | None = None,
    ) -> None:
        super().__init__(config, dtype=dtype, device=device, chunking=chunking)
        local_theta = config.rope_local_theta
        self.local_rotary = (
            self.rotary
            if local_theta is None
            else RotaryEmbedding(config.head_dim, local_theta, None, dtype, interleaved=config.rope_interleaved)
        )
        self.local_backend: AttentionBackend = self.backend
        self.use_attention(TorchAttentionBackend)

    def _decoder_layer(
        self, index: int, *, dtype: torch.dtype, device: torch.device | str, chunking: RowChunking
    ) -> nn.Module:
        return VariantDecoderLayer(self.config, index, dtype=dtype, device=device, chunking=chunking)

    def use_attention(self, backend: Callable[..., AttentionBackend]) -> None:
        """Attend through backend(sliding_window=...): one for the full-attention layers, one for the sliding ones."""
        if self.llama_shaped():
            self.backend = self.local_backend = backend(sliding_window=self.config.sliding_window)
            return
        softcap = self.config.attn_logit_softcapping
        extra = {} if softcap is None else {"softcap": softcap}
        self.backend = backend(sliding_window=None, **extra)
        self.local_backend = backend(sliding_window=self.config.sliding_window, **extra)

    def llama_shaped(self) -> bool:
        """Whether, once loaded, the model computes what Llama's would (Phi-3): then it runs Llama's forward."""
        return not self._departures()

    def fusable(self) -> bool:
        """Whether the fused decoder computes this model: Llama's block, its MLPs dense or mixtures of experts
        (Qwen3-MoE, Mixtral), or the blocks of Gemma 2/3, Granite and OLMo 2."""
        return self._departures() <= _FUSABLE_FIELDS

    def _departures(self) -> set[str]:
        """The config's fields that differ from Llama's, but for how the checkpoint stores its projections."""
        config = self.config
        names = [f.name for f in fields(config)]
        defaults = ModelConfig(config.architecture, *([0] * 8))
        return {
            name
            for name in names[names.index("eos_token_ids") + 1 :]
            if name != "fused_projections" and getattr(config, name) != getattr(defaults, name)
        }

    def unsupported_paths(self) -> dict[str, str]:
        """The compute paths this model cannot run, each with the feature the path lacks."""
        unsupported = {}
        if self.config.num_experts:
            unsupported["triton"] = "mixture of experts (its routing reads the chosen experts on the host)"
        return unsupported

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVView,
        meta: AttentionMetadata,
        is_prompt: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for a flat batch of T tokens (see LlamaForCausalLM)."""
        if self.llama_shaped():
            return super().forward(input_ids, positions, kv_cache, meta, is_prompt)
        self.chunking.set_rows(is_prompt, self.device)
        longest = max(meta.seq_lens)
        full = ForwardStep(self.ops.prepare_rope(positions, longest, self.rotary), meta, self.backend, self.ops)
        local_rope = full.rope
        if self.local_rotary is not self.rotary:
            local_rope = self.ops.prepare_rope(positions, longest, self.local_rotary)
        steps = {FULL: full, SLIDING: ForwardStep(local_rope, meta, self.local_backend, self.ops)}
        x, residual = self.embed_tokens(input_ids), None
        if self.config.embedding_multiplier != 1.0:
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)  # rounded as transformers does
        arithmetic = self._arithmetic()
        if self.fused is not None and arithmetic is not None:  # fusable
            return self.fused(x, full.rope, kv_cache, meta, arithmetic, None if local_rope is full.rope else local_rope)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, kv_cache.layers[i], steps[layer.kind])
        assert residual is not None
        return self.ops.add_rms_norm(residual, x, self.norm.weight, self.norm.eps)

    def compute_logits(self, hidden: torch.Tensor, is_prompt: torch.Tensor | None = None) -> torch.Tensor:
        """Llama's logits, scaled and soft-capped where the config says."""
        logits = super().compute_logits(hidden, is_prompt)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> dict[str, PackedWeight]:
        """Llama's loading; Gemma's norms scale by (1 + weight), which the loaded norm weights then hold."""
        experts = self.config.num_experts
        packed = super().load_weights(per_expert_weights(weights, experts) if experts else weights)
        if self.config.architecture in GEMMA:
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.data.add_(1.0)
        return packed

    def linear_groups(self) -> Iterator[tuple[nn.Module, str, list[str]]]:
        """Llama's groups; a checkpoint with fused projections has one weight per fused linear."""
        for owner, attribute, names in super().linear_groups():
            if isinstance(owner, MoEMLP):  # the router and each expert's own linears
                if attribute == "gate_up_proj":
                    yield from owner.linear_groups(names[0].removesuffix("gate_proj.weight"))
                continue
            if self.config.fused_projections and attribute in _FUSED:
                names = [names[0].replace(f".{_FUSED[attribute][1][0]}.", f".{attribute}.")]
            yield owner, attribute, names

    def _hf_targets(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        targets = super()._hf_targets()
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            for name, norm in layer.extra_norms().items():
                targets[f"{prefix}{name}.weight"] = _whole(norm.weight)
            if layer.layout == "post":  # its input_layernorm stays unused
                del targets[f"{prefix}input_layernorm.weight"]
            if self.config.fused_projections:
                for attribute, (owner, parts) in _FUSED.items():
                    for part in parts:
                        del targets[f"{prefix}{owner}.{part}.weight"]
                    targets[f"{prefix}{owner}.{attribute}.weight"] = _whole(
                        getattr(getattr(layer, owner), attribute).weight
                    )
        return targets


def layer_kind(config: ModelConfig, index: int) -> str:
    """SLIDING or FULL: how layer index attends."""
    if config.layer_types:
        return config.layer_types[index]
    return SLIDING if config.sliding_window else FULL


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that runs config's architecture."""
    return VariantForCausalLM if config.architecture in VARIANT_ARCHITECTURES else LlamaForCausalLM
