"""BERT-family encoders (BERT, BGE, E5, all-MiniLM) and BERT cross-encoders (rerankers), over flat batches.

A batch is the concatenation of its sequences' tokens ([T, hidden]): the linears run in fixed-size row chunks
(so a row's result does not depend on the rest of the batch) and attention runs per sequence, bidirectional, with
no padding anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from statelm.models.config import ModelConfigError
from statelm.models.layers import RowChunking, chunked_linear

HF_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")
GGUF_ARCHITECTURE = "bert"
# llama.cpp's tensor names for BERT, as Hugging Face names them (under an optional `bert.` prefix)
_GGUF_NAMES = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
_GGUF_TENSOR = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class BertConfig:
    """The shape of a BERT encoder; num_labels > 0 for a cross-encoder's classification head."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    num_labels: int = 0

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> BertConfig:
        """From a Hugging Face config.json of a BertModel or BertForSequenceClassification."""
        architectures = config.get("architectures") or ["BertModel"]
        if architectures[0] not in HF_ARCHITECTURES or config.get("hidden_act", "gelu") != "gelu":
            raise ModelConfigError(f"not a BERT encoder statelm runs: {architectures[0]}, {config.get('hidden_act')}")
        labels = 0
        if architectures[0] == "BertForSequenceClassification":
            labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_position_embeddings=config["max_position_embeddings"],
            type_vocab_size=config.get("type_vocab_size", 2),
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            num_labels=labels,
        )

    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any], vocab_size: int, type_vocab_size: int) -> BertConfig:
        """From a GGUF file's `bert.*` metadata."""

        def key(name: str) -> Any:
            value = fields.get(f"{GGUF_ARCHITECTURE}.{name}")
            if value is None:
                raise ModelConfigError(f"the GGUF file has no {GGUF_ARCHITECTURE}.{name}")
            return value

        return cls(
            vocab_size=vocab_size,
            hidden_size=int(key("embedding_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=int(key("attention.head_count")),
            intermediate_size=int(key("feed_forward_length")),
            max_position_embeddings=int(key("context_length")),
            type_vocab_size=type_vocab_size,
            layer_norm_eps=float(key("attention.layer_norm_epsilon")),
        )


def gguf_to_hf_name(name: str) -> str:
    """A llama.cpp BERT tensor name as Hugging Face's BertModel names it."""
    match = _GGUF_TENSOR.match(name)
    if match is None:
        raise ModelConfigError(f"unexpected tensor {name} in a BERT GGUF file")
    layer, base, kind = match.groups()
    if layer is None and base in _GGUF_NAMES:
        return f"{_GGUF_NAMES[base]}.{kind}"
    if layer is not None and base in _GGUF_LAYER_NAMES:
        return f"encoder.layer.{layer}.{_GGUF_LAYER_NAMES[base]}.{kind}"
    raise ModelConfigError(f"unexpected tensor {name} in a BERT GGUF file")


class BertLayer(nn.Module):
    """Post-norm transformer block: bidirectional self-attention, then a GELU feed-forward."""

    def __init__(self, config: BertConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // config.num_attention_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.attn_out = nn.Linear(hidden, hidden, dtype=dtype)
        self.attn_norm = nn.LayerNorm(hidden, config.layer_norm_eps, dtype=dtype)
        self.up = nn.Linear(hidden, inner, dtype=dtype)
        self.down = nn.Linear(inner, hidden, dtype=dtype)
        self.out_norm = nn.LayerNorm(hidden, config.layer_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor, seq_lens: list[int], row_chunk: int) -> torch.Tensor:
        """The block's output for a flat batch [T, hidden] of sequences of seq_lens tokens."""
        qkv = chunked_linear(x, self.qkv.weight, self.qkv.bias, row_chunk)
        q, k, v = qkv.view(x.shape[0], 3, self.num_heads, self.head_dim).permute(1, 2, 0, 3)  # each [heads, T, d]
        attended = torch.cat(
            [
                F.scaled_dot_product_attention(q[:, s], k[:, s], v[:, s])
                for s in _slices(seq_lens)
            ],
            dim=1,
        )  # [heads, T, d]
        attended = attended.transpose(0, 1).reshape(x.shape[0], -1)
        x = self.attn_norm(x + chunked_linear(attended, self.attn_out.weight, self.attn_out.bias, row_chunk))
        inner = F.gelu(chunked_linear(x, self.up.weight, self.up.bias, row_chunk))
        return self.out_norm(x + chunked_linear(inner, self.down.weight, self.down.bias, row_chunk))


def _slices(seq_lens: list[int]) -> Iterable[slice]:
    start = 0
    for length in seq_lens:
        yield slice(start, start + length)
        start += length


class BertEncoder(nn.Module):
    """A BERT encoder: token, position and segment embeddings, post-norm blocks, and for a cross-encoder the
    pooler and classifier over the first ([CLS]) token."""

    def __init__(self, config: BertConfig, dtype: torch.dtype = torch.float32, device: torch.device | None = None):
        super().__init__()
        self.config = config
        self.row_chunk = RowChunking.batch_invariant(device).prompt
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden, dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden, dtype=dtype)
        self.embedding_norm = nn.LayerNorm(hidden, config.layer_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.pooler: nn.Linear | None = None
        self.classifier: nn.Linear | None = None
        if config.num_labels:
            self.pooler = nn.Linear(hidden, hidden, dtype=dtype)
            self.classifier = nn.Linear(hidden, config.num_labels, dtype=dtype)
        self.requires_grad_(False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor, seq_lens: list[int]
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of a flat batch of T tokens in sequences of seq_lens tokens."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embedding_norm(x + self.token_type_embeddings(token_types))
        for layer in self.layers:
            x = layer(x, seq_lens, self.row_chunk)
        return x

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's logits [B, num_labels] from each sequence's first-token state [B, hidden]."""
        assert self.pooler is not None and self.classifier is not None, "not a cross-encoder"
        pooled = torch.tanh(chunked_linear(first_rows, self.pooler.weight, self.pooler.bias, self.row_chunk))
        return chunked_linear(pooled, self.classifier.weight, self.classifier.bias, self.row_chunk).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors (BertModel's, under an optional `bert.` prefix) into the model."""
        targets = self._targets()
        pending = set(targets)
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name not in targets:
                if (name.startswith("pooler.") and self.pooler is None) or name.endswith("position_ids"):
                    continue  # an embedding model's unused pooler; a buffer of positions
                raise ModelConfigError(f"unexpected tensor {name} for a BERT model")
            parameter, row = targets[name]
            rows = parameter.shape[0] // 3 if row is not None else parameter.shape[0]
            destination = parameter.data if row is None else parameter.data[row * rows : (row + 1) * rows]
            if destination.shape != tensor.shape:
                raise ModelConfigError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}")
            destination.copy_(tensor)
            pending.discard(name)
        if pending:
            raise ModelConfigError(f"BERT weights missing: {', '.join(sorted(pending)[:5])}")

    def _targets(self) -> dict[str, tuple[nn.Parameter, int | None]]:
        """Hugging Face names → (parameter, which third of a fused QKV or None)."""
        targets: dict[str, tuple[nn.Parameter, int | None]] = {}
        modules: dict[str, nn.Module] = {
            "embeddings.word_embeddings": self.word_embeddings,
            "embeddings.position_embeddings": self.position_embeddings,
            "embeddings.token_type_embeddings": self.token_type_embeddings,
            "embeddings.LayerNorm": self.embedding_norm,
        }
        if self.pooler is not None and self.classifier is not None:
            modules |= {"pooler.dense": self.pooler, "classifier": self.classifier}
        for i, layer in enumerate(self.layers):
            prefix = f"encoder.layer.{i}."
            for third, part in enumerate(("query", "key", "value")):
                for kind in ("weight", "bias"):
                    targets[f"{prefix}attention.self.{part}.{kind}"] = (getattr(layer.qkv, kind), third)
            modules |= {
                f"{prefix}attention.output.dense": layer.attn_out,
                f"{prefix}attention.output.LayerNorm": layer.attn_norm,
                f"{prefix}intermediate.dense": layer.up,
                f"{prefix}output.dense": layer.down,
                f"{prefix}output.LayerNorm": layer.out_norm,
            }
        for prefix, module in modules.items():
            for kind, parameter in module.named_parameters(recurse=False):
                targets[f"{prefix}.{kind}"] = (parameter, None)
        return targets
