"""BERT-family encoders (BERT, BGE, E5, all-MiniLM; nomic-bert's rotary, SwiGLU variant) and BERT cross-encoders
(rerankers), over flat batches.

A batch is the concatenation of its sequences' tokens ([T, hidden]): the linears run in fixed-size row chunks
(so a row's result does not depend on the rest of the batch) and attention runs per sequence, bidirectional, with
no padding anywhere.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from statelm.models.config import ModelConfigError
from statelm.models.layers import RotaryEmbedding, RowChunking, apply_rope, chunked_linear

HF_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")
GGUF_ARCHITECTURES = ("bert", "nomic-bert")  # llama.cpp's names; nomic-bert's positions are rotary
ROTARY_GGUF_ARCHITECTURE = "nomic-bert"
DEFAULT_ROPE_THETA = 10000.0  # llama.cpp's when a GGUF file gives no rope.freq_base


@dataclass(frozen=True)
class TensorNames:
    """How one checkpoint format names BertEncoder's parameters: outside the layers (`top`) and within layer N
    (`layer`, after a prefix that layer_pattern matches with N as its group). A name maps to a module and, for the
    query, key or value of a fused QKV, which third of it."""

    layer_pattern: str
    top: Mapping[str, str]
    layer: Mapping[str, str | tuple[str, int]]
    strip_prefix: str = ""  # a model class's prefix some checkpoints carry (`bert.`)

    def target(self, name: str) -> tuple[str, int | None] | None:
        """(BertEncoder's parameter name, the third of a fused QKV or None) for a checkpoint tensor's name; None
        for a buffer of positions, which holds no weights."""
        name = name.removeprefix(self.strip_prefix)
        if name.endswith("position_ids"):
            return None
        base, _, kind = name.rpartition(".")
        match = re.match(self.layer_pattern, base)
        entry = self.layer.get(base[match.end() :]) if match else self.top.get(base)
        if entry is None or kind not in ("weight", "bias"):
            raise ModelConfigError(f"unexpected tensor {name}")
        module, third = (entry, None) if isinstance(entry, str) else entry
        prefix = f"layers.{match.group(1)}." if match else ""
        return f"{prefix}{module}.{kind}", third


HF_BERT_NAMES = TensorNames(
    layer_pattern=r"encoder\.layer\.(\d+)\.",
    top={
        "embeddings.word_embeddings": "word_embeddings",
        "embeddings.position_embeddings": "position_embeddings",
        "embeddings.token_type_embeddings": "token_type_embeddings",
        "embeddings.LayerNorm": "embedding_norm",
        "pooler.dense": "pooler",
        "classifier": "classifier",
    },
    layer={
        "attention.self.query": ("qkv", 0),
        "attention.self.key": ("qkv", 1),
        "attention.self.value": ("qkv", 2),
        "attention.output.dense": "attn_out",
        "attention.output.LayerNorm": "attn_norm",
        "intermediate.dense": "up",
        "output.dense": "down",
        "output.LayerNorm": "out_norm",
    },
    strip_prefix="bert.",
)
GGUF_NAMES = TensorNames(  # llama.cpp's, the same for bert and nomic-bert
    layer_pattern=r"blk\.(\d+)\.",
    top={
        "token_embd": "word_embeddings",
        "position_embd": "position_embeddings",
        "token_types": "token_type_embeddings",
        "token_embd_norm": "embedding_norm",
        "cls": "pooler",  # a cross-encoder's head: BERT's pooler, which llama.cpp's converter leaves out
        "cls.output": "classifier",
    },
    layer={
        "attn_qkv": "qkv",
        "attn_q": ("qkv", 0),
        "attn_k": ("qkv", 1),
        "attn_v": ("qkv", 2),
        "attn_output": "attn_out",
        "attn_output_norm": "attn_norm",
        "ffn_up": "up",
        "ffn_gate": "gate",
        "ffn_down": "down",
        "layer_output_norm": "out_norm",
    },
)


@dataclass(frozen=True)
class BertConfig:
    """The shape of a BERT-family encoder; num_labels > 0 for a cross-encoder's classification head."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int  # the context: the learned position table's rows, or as far as rotary goes
    type_vocab_size: int = 2  # 0: no segment embeddings
    layer_norm_eps: float = 1e-12
    num_labels: int = 0
    pooler: bool = True  # a cross-encoder's dense and tanh over [CLS] before its classifier
    rope_theta: float | None = None  # rotary positions (nomic-bert) instead of a learned position table
    gated_mlp: bool = False  # a SwiGLU feed-forward, silu(gate(x)) * up(x), instead of gelu(up(x))
    linear_bias: bool = True

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
    def from_gguf(
        cls, fields: Mapping[str, Any], tensor_names: set[str], vocab_size: int, type_vocab_size: int
    ) -> BertConfig:
        """From a GGUF file's `<architecture>.*` metadata (bert or nomic-bert) and which tensors it holds; a bert
        file with a classifier (`cls.output`) is a cross-encoder with as many labels as
        `<architecture>.classifier.output_labels` names (one when it names none, as llama.cpp reads it)."""
        architecture = fields.get("general.architecture")
        if architecture not in GGUF_ARCHITECTURES:
            raise ModelConfigError(f"architecture {architecture!r} is not an encoder statelm runs (bert, nomic-bert)")

        def key(name: str) -> Any:
            value = fields.get(f"{architecture}.{name}")
            if value is None:
                raise ModelConfigError(f"the GGUF file has no {architecture}.{name}")
            return value

        rotary = architecture == ROTARY_GGUF_ARCHITECTURE
        labels = 0
        if not rotary and "cls.output.weight" in tensor_names:
            labels = len(fields.get(f"{architecture}.classifier.output_labels") or [None])
        return cls(
            vocab_size=vocab_size,
            hidden_size=int(key("embedding_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=int(key("attention.head_count")),
            intermediate_size=int(key("feed_forward_length")),
            max_position_embeddings=int(key("context_length")),
            type_vocab_size=type_vocab_size,
            layer_norm_eps=float(key("attention.layer_norm_epsilon")),
            num_labels=labels,
            pooler="cls.weight" in tensor_names,
            rope_theta=float(fields.get(f"{architecture}.rope.freq_base", DEFAULT_ROPE_THETA)) if rotary else None,
            gated_mlp="blk.0.ffn_gate.weight" in tensor_names,
            linear_bias="blk.0.attn_output.bias" in tensor_names,
        )


class BertLayer(nn.Module):
    """Post-norm transformer block: bidirectional self-attention (rotary where the model says), then a GELU or
    SwiGLU feed-forward."""

    def __init__(self, config: BertConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.linear_bias
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // config.num_attention_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias, dtype=dtype)
        self.attn_out = nn.Linear(hidden, hidden, bias=bias, dtype=dtype)
        self.attn_norm = nn.LayerNorm(hidden, config.layer_norm_eps, dtype=dtype)
        self.up = nn.Linear(hidden, inner, bias=bias, dtype=dtype)
        self.gate = nn.Linear(hidden, inner, bias=bias, dtype=dtype) if config.gated_mlp else None
        self.down = nn.Linear(inner, hidden, bias=bias, dtype=dtype)
        self.out_norm = nn.LayerNorm(hidden, config.layer_norm_eps, dtype=dtype)

    def forward(
        self, x: torch.Tensor, seq_lens: list[int], row_chunk: int, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """The block's output for a flat batch [T, hidden] of sequences of seq_lens tokens; rope is the tokens'
        rotary cos and sin ([T, 1, head_dim] each) for a rotary model."""
        qkv = chunked_linear(x, self.qkv.weight, self.qkv.bias, row_chunk)
        q, k, v = qkv.view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)  # each [T, heads, d]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # each [heads, T, d]
        attended = torch.cat(
            [F.scaled_dot_product_attention(q[:, s], k[:, s], v[:, s]) for s in _slices(seq_lens)],
            dim=1,
        )  # [heads, T, d]
        attended = attended.transpose(0, 1).reshape(x.shape[0], -1)
        x = self.attn_norm(x + chunked_linear(attended, self.attn_out.weight, self.attn_out.bias, row_chunk))
        inner = chunked_linear(x, self.up.weight, self.up.bias, row_chunk)
        if self.gate is None:
            inner = F.gelu(inner)
        else:
            inner = F.silu(chunked_linear(x, self.gate.weight, self.gate.bias, row_chunk)) * inner
        return self.out_norm(x + chunked_linear(inner, self.down.weight, self.down.bias, row_chunk))


def _slices(seq_lens: list[int]) -> Iterable[slice]:
    start = 0
    for length in seq_lens:
        yield slice(start, start + length)
        start += length


class BertEncoder(nn.Module):
    """A BERT-family encoder: token and segment embeddings with a learned position table (or rotary positions in
    the blocks), post-norm blocks, and for a cross-encoder the pooler and classifier over the first ([CLS])
    token."""

    def __init__(self, config: BertConfig, dtype: torch.dtype = torch.float32, device: torch.device | None = None):
        super().__init__()
        self.config = config
        self.row_chunk = RowChunking.batch_invariant(device).prompt
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden, dtype=dtype)
        self.position_embeddings: nn.Embedding | None = None
        self.rotary: RotaryEmbedding | None = None
        if config.rope_theta is None:
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden, dtype=dtype)
        else:
            self.rotary = RotaryEmbedding(hidden // config.num_attention_heads, config.rope_theta, None, dtype)
        self.token_type_embeddings: nn.Embedding | None = None
        if config.type_vocab_size:
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden, dtype=dtype)
        self.embedding_norm = nn.LayerNorm(hidden, config.layer_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.pooler: nn.Linear | None = None
        self.classifier: nn.Linear | None = None
        if config.num_labels:
            if config.pooler:
                self.pooler = nn.Linear(hidden, hidden, dtype=dtype)
            self.classifier = nn.Linear(hidden, config.num_labels, dtype=dtype)
        self.requires_grad_(False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor, seq_lens: list[int]
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of a flat batch of T tokens in sequences of seq_lens tokens."""
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(positions)
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(token_types)
        x = self.embedding_norm(x)
        rope = None
        if self.rotary is not None:
            rope = self.rotary.cos_sin(positions, self.config.max_position_embeddings)
        for layer in self.layers:
            x = layer(x, seq_lens, self.row_chunk, rope)
        return x

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's logits [B, num_labels] from each sequence's first-token state [B, hidden]."""
        assert self.classifier is not None, "not a cross-encoder"
        pooled = first_rows
        if self.pooler is not None:
            pooled = torch.tanh(chunked_linear(first_rows, self.pooler.weight, self.pooler.bias, self.row_chunk))
        return chunked_linear(pooled, self.classifier.weight, self.classifier.bias, self.row_chunk).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], names: TensorNames) -> None:
        """Copy a checkpoint's tensors, named as `names` says, into the model; every parameter must be filled."""
        parameters = dict(self.named_parameters())
        filled: dict[str, set[int | None]] = defaultdict(set)
        for name, tensor in weights:
            target = names.target(name)
            if target is None:
                continue
            parameter_name, third = target
            if parameter_name not in parameters:
                if parameter_name.startswith("pooler.") and self.classifier is None:
                    continue  # an embedding model's unused pooler
                raise ModelConfigError(f"unexpected tensor {name} for this encoder")
            parameter = parameters[parameter_name].data
            destination = parameter if third is None else parameter.chunk(3)[third]
            if destination.shape != tensor.shape:
                raise ModelConfigError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}")
            destination.copy_(tensor)
            filled[parameter_name].add(third)
        missing = [name for name in parameters if None not in filled[name] and len(filled[name]) < 3]
        if missing:
            raise ModelConfigError(f"encoder weights missing: {', '.join(sorted(missing)[:5])}")
