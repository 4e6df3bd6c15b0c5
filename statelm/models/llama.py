"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache: its layers and its weight map.

Which kernels run it (attention backend, layer ops, packed linears, fused decoder, activations) is set by the
compute-path pass (compute_path.py), not chosen here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from statelm.attention.base import AttentionBackend, AttentionMetadata, KVView
from statelm.attention.layer_kv import LayerKV
from statelm.attention.reference import TorchAttentionBackend
from statelm.models.config import ModelConfig
from statelm.models.layers import (
    GatedMLP,
    LayerOps,
    RMSNorm,
    RopeInputs,
    RotaryEmbedding,
    RowChunkedLinear,
    RowChunking,
    chunked_linear,
)
from statelm.models.packed import ACTIVATIONS, PackedLinear

if TYPE_CHECKING:
    from statelm.kernels.quant import PackedWeight

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class DecoderStack(Protocol):
    """Every decoder layer and the final norm in one call (the compute-path pass sets one: FusedDecoder)."""

    def __call__(
        self,
        x: torch.Tensor,
        rope: RopeInputs,
        kv_cache: KVView,
        meta: AttentionMetadata,
        arithmetic: str,
        local_rope: RopeInputs | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, from the embeddings x [T, hidden] (a variant's sliding layers rotate
        by local_rope where it has its own)."""
        ...


@dataclass
class ForwardStep:
    """What every layer of one forward shares: rope inputs, the attention layout and backend, the layer ops."""

    rope: RopeInputs
    meta: AttentionMetadata
    backend: AttentionBackend
    ops: LayerOps


class LlamaAttention(nn.Module):
    """Self-attention with fused QKV projection, optional q/k RMSNorm (Qwen3) and rope."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str, chunking: RowChunking
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale or self.head_dim**-0.5
        out_bias = config.attention_bias and config.architecture != "qwen2"
        hidden = config.hidden_size
        linear = {"dtype": dtype, "device": device, "chunking": chunking}
        self.qkv_proj = RowChunkedLinear(hidden, self.q_size + 2 * self.kv_size, bias=config.attention_bias, **linear)
        self.o_proj = RowChunkedLinear(self.q_size, hidden, bias=out_bias, **linear)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:  # per head, or over all heads at once (qk_norm_full)
            q_width, k_width = (self.q_size, self.kv_size) if config.qk_norm_full else (self.head_dim, self.head_dim)
            self.q_norm = RMSNorm(q_width, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(k_width, config.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cache: LayerKV, step: ForwardStep) -> torch.Tensor:
        """Project [T, hidden], write K/V to the cache, attend, and project back."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_width, k_width = self.q_norm.weight.shape[0], self.k_norm.weight.shape[0]
            q = step.ops.rms_norm(q.view(tokens, -1, q_width), self.q_norm.weight, self.q_norm.eps).view(q.shape)
            k = step.ops.rms_norm(k.view(tokens, -1, k_width), self.k_norm.weight, self.k_norm.eps).view(k.shape)
        q, k = step.ops.rope(q, k, step.rope)
        out = step.backend.forward(q, k, v, cache, step.meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then gated MLP, each with a residual connection."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str, chunking: RowChunking
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.self_attn = LlamaAttention(config, dtype=dtype, device=device, chunking=chunking)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype=dtype, device=device, chunking=chunking)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cache: LayerKV,
        step: ForwardStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the block on the flat batch [T, hidden]: x is the previous block's output, not yet added to residual.

        Returns this block's output and the residual stream, whose sum is the block's result.
        """
        norm = self.input_layernorm
        if residual is None:
            residual, h = x, step.ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h = step.ops.add_rms_norm(residual, x, norm.weight, norm.eps)
        attention = self.self_attn(h, cache, step)
        norm = self.post_attention_layernorm
        h = step.ops.add_rms_norm(residual, attention, norm.weight, norm.eps)
        return self.mlp(h, step.ops), residual


class LlamaForCausalLM(nn.Module):
    """Decoder-only language model of the Llama family, reading and writing a paged KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        chunking: RowChunking | None = None,
    ) -> None:
        super().__init__()
        chunking = chunking or RowChunking()
        self.chunking = chunking
        self.batch_invariant = chunking.enabled
        self.config = config
        self.device = torch.device(device)
        # how it runs, until the compute-path pass (compute_path.py) sets it otherwise
        self.backend: AttentionBackend = TorchAttentionBackend(sliding_window=config.sliding_window)
        self.compute_path = "torch"
        self.ops = LayerOps()
        self.activations = "float32"  # of the packed linears
        self.fused: DecoderStack | None = None  # all layers in one C++ call (kernels path, all linears packed)
        self.dtype = dtype
        meta = torch.device("meta")
        # an explicit empty weight skips nn.Embedding's random init, whose first call on meta costs seconds
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=meta),
        )
        self.layers = nn.ModuleList(
            self._decoder_layer(i, dtype=dtype, device=meta, chunking=chunking) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=meta)
        self.lm_head: nn.Parameter | None = None
        self.packed_head: PackedLinear | None = None  # the LM head when its weight is packed (tied or not)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=meta))
        _materialize(self, torch.device(device))
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, dtype, interleaved=config.rope_interleaved
        )
        self._targets = self._hf_targets()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVView,
        meta: AttentionMetadata,
        is_prompt: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for a flat batch of T tokens.

        is_prompt ([T] bool, best on the host) marks prompt-token rows for the row chunking; None: all generated.
        """
        self.chunking.set_rows(is_prompt, self.device)
        step = ForwardStep(
            rope=self.ops.prepare_rope(positions, max(meta.seq_lens), self.rotary),
            meta=meta,
            backend=self.backend,
            ops=self.ops,
        )
        x, residual = self.embed_tokens(input_ids), None
        arithmetic = self._arithmetic()
        if self.fused is not None and arithmetic is not None:
            return self.fused(x, step.rope, kv_cache, meta, arithmetic)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, kv_cache.layers[i], step)
        assert residual is not None
        return self.ops.add_rms_norm(residual, x, self.norm.weight, self.norm.eps)

    def _decoder_layer(
        self, index: int, *, dtype: torch.dtype, device: torch.device | str, chunking: RowChunking
    ) -> nn.Module:
        """Decoder layer `index` (a variant's class builds its own, models/variants.py)."""
        return LlamaDecoderLayer(self.config, dtype=dtype, device=device, chunking=chunking)

    def _arithmetic(self) -> str | None:
        """The arithmetic of this forward's packed matmuls (see ACTIVATIONS): one for all rows, or None for a step
        that mixes prompt and generated rows of different arithmetics."""
        prompt, generated = ACTIVATIONS[self.activations]
        if prompt == generated or self.chunking.prompt_rows is None:
            return generated
        return prompt if self.chunking.generated_rows is None else None

    def compute_logits(self, hidden: torch.Tensor, is_prompt: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [N, vocab] for the rows that sample; is_prompt ([N] bool) marks last prompt tokens' rows
        (None: all generated), which take the prompt rows' arithmetic."""
        head = self.packed_head
        if head is not None and head.use_kernel:
            self.chunking.set_rows(is_prompt, self.device)
            return head(hidden)
        if head is not None:
            weight = head.dense(hidden.dtype)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        return chunked_linear(hidden, weight, None, self.chunking.generated).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> dict[str, PackedWeight]:
        """Copy Hugging Face-named tensors into the (fused) parameters; returns the packed weights, checked against
        the shapes they fill, for `install_packed` (compute_path.py) to put in place."""
        pending = set(self._targets)
        unknown: list[str] = []
        packed: dict[str, PackedWeight] = {}
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name not in self._targets:
                unknown.append(name)
                continue
            param, start, end = self._targets[name]
            target = param.data[start:end]
            is_packed = not isinstance(tensor, torch.Tensor)
            shape = (tensor.out_features, tensor.in_features) if is_packed else tensor.shape
            if target.shape != shape:
                raise ValueError(f"weight {name} has shape {tuple(shape)}, expected {tuple(target.shape)}")
            if is_packed:
                packed[name] = tensor
            else:
                target.copy_(tensor)
            pending.discard(name)
        if unknown or pending:
            raise ValueError(
                f"checkpoint does not match {self.config.architecture}: "
                f"unknown weights {sorted(unknown)}, missing weights {sorted(pending)}"
            )
        return packed

    def copy_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one Hugging Face-named tensor into the parameter rows it fills."""
        param, start, end = self._targets[name]
        param.data[start:end].copy_(tensor)

    def linear_groups(self) -> Iterator[tuple[nn.Module, str, list[str]]]:
        """Each linear layer and the Hugging Face weights fused into it: (owning module, attribute, weight names)."""
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            groups = {
                "qkv_proj": (attn, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                "o_proj": (attn, ["self_attn.o_proj"]),
                "gate_up_proj": (mlp, ["mlp.gate_proj", "mlp.up_proj"]),
                "down_proj": (mlp, ["mlp.down_proj"]),
            }
            for attribute, (owner, parts) in groups.items():
                yield owner, attribute, [f"{prefix}{part}.weight" for part in parts]

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights for benchmarks and tests: normal(0, 0.02) matrices, zero biases, unit norms.

        Drawn on the model's device (an 8B model's in seconds on a GPU), so the same seed gives other weights on
        another device.
        """
        generator = torch.Generator(device=self.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.data.fill_(1.0)
            elif name.endswith("bias"):
                param.data.zero_()
            else:
                values = torch.randn(param.shape, generator=generator, device=self.device, dtype=torch.float32)
                param.data.copy_(values.mul_(0.02))

    def _hf_targets(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        """Map each Hugging Face weight name to (parameter, first row, end row) it fills."""
        targets: dict[str, tuple[nn.Parameter, int, int]] = {
            "model.embed_tokens.weight": _whole(self.embed_tokens.weight),
            "model.norm.weight": _whole(self.norm.weight),
        }
        if self.lm_head is not None:
            targets["lm_head.weight"] = _whole(self.lm_head)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            targets.update({prefix + name: target for name, target in _layer_targets(layer).items()})
        return targets


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter uninitialised storage on device (what to_empty does, without its slow path)."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            storage = torch.empty(param.shape, dtype=param.dtype, device=device)
            module._parameters[name] = nn.Parameter(storage, requires_grad=False)


def _whole(param: nn.Parameter) -> tuple[nn.Parameter, int, int]:
    return param, 0, param.shape[0]


def _layer_targets(layer: LlamaDecoderLayer) -> dict[str, tuple[nn.Parameter, int, int]]:
    """Hugging Face names of one decoder layer, relative to `model.layers.N.`."""
    attn = layer.self_attn
    q, kv = attn.q_size, attn.kv_size
    rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    targets: dict[str, tuple[nn.Parameter, int, int]] = {
        "input_layernorm.weight": _whole(layer.input_layernorm.weight),
        "post_attention_layernorm.weight": _whole(layer.post_attention_layernorm.weight),
        "self_attn.o_proj.weight": _whole(attn.o_proj.weight),
        **{f"mlp.{name}": target for name, target in layer.mlp.targets().items()},
    }
    for proj, (start, end) in rows.items():
        targets[f"self_attn.{proj}.weight"] = (attn.qkv_proj.weight, start, end)
        if attn.qkv_proj.bias is not None:
            targets[f"self_attn.{proj}.bias"] = (attn.qkv_proj.bias, start, end)
    if attn.o_proj.bias is not None:
        targets["self_attn.o_proj.bias"] = _whole(attn.o_proj.bias)
    if attn.q_norm is not None and attn.k_norm is not None:
        targets["self_attn.q_norm.weight"] = _whole(attn.q_norm.weight)
        targets["self_attn.k_norm.weight"] = _whole(attn.k_norm.weight)
    return targets
