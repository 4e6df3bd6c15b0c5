"""Read GGUF files: config and tokenizer from metadata, weights dequantized to Hugging Face names."""

from __future__ import annotations

import hashlib
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from statelm.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from statelm.models.gguf_variants import (
    LONGROPE_TENSORS,
    block_names,
    gguf_variant_fields,
    longrope_scaling,
    to_hf_values,
)
from statelm.models.rope import complete_rope_scaling
from statelm.tokenizer import Tokenizer, TokenizerError

if TYPE_CHECKING:
    from statelm.kernels.quant import PackedWeight

Q = GGMLQuantizationType
SUPPORTED_QUANT_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
# llama.cpp's converter interleaves the rows of Q/K for these architectures (rotary layout); see unpermute_qk.
PERMUTED_QK_ARCHITECTURES = frozenset({"llama", "mistral", "granite", "mixtral"})
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
# Tensors the loader reads into the config instead of yielding as weights.
_CONFIG_TENSORS = frozenset({"rope_freqs.weight", *LONGROPE_TENSORS})

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"^(\w+)\.(weight|bias)$")


class GGUFError(ValueError):
    """A GGUF file statelm cannot read or run."""


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face parameter name of a GGUF tensor (`blk.0.attn_q.weight` -> `model.layers.0...`)."""
    block = _BLOCK_TENSOR.match(gguf_name)
    names = {**_BLOCK_NAMES, **block_names(arch)}
    if block and block.group(2) in names:
        layer, part, kind = block.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
    top = _GLOBAL_TENSOR.match(gguf_name)
    if top and top.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[top.group(1)]}.{top.group(2)}"
    raise GGUFError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_qk(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows (weights or biases) back to the Hugging Face layout."""
    rows = tensor.shape[0]
    rest = tensor.shape[1:]
    return tensor.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(tensor.shape)


@dataclass
class GGUFModel:
    """A GGUF file opened for loading: its config, tokenizer, fingerprint and (lazily) its weights."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    metadata_digest: str
    dtype: torch.dtype
    reader: GGUFReader
    fields: dict[str, Any]  # the decoded key/value metadata

    def tensors(self, packed: bool = False) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        """Yield `(hf_name, tensor)` pairs with a progress bar on stderr.

        Tensors are dequantized to `dtype`; with `packed`, quantized matrices stay in a packed layout instead
        (see statelm.kernels.quant.pack_gguf for what each GGUF type becomes).
        """
        weights = [t for t in self.reader.tensors if t.name not in _CONFIG_TENSORS]
        arch = self.config.architecture
        for tensor in tqdm(weights, desc="converting GGUF", unit="tensor", file=sys.stderr):
            name = hf_tensor_name(tensor.name, arch)
            if packed and tensor.tensor_type not in FLOAT_TYPES and len(tensor.shape) == 2:
                yield name, self._pack(tensor)
            else:
                yield name, self._convert(tensor, name)

    def _convert(self, tensor: ReaderTensor, hf_name: str) -> torch.Tensor:
        value = to_hf_values(self.config.architecture, hf_name, torch.from_numpy(_dequantize(tensor))).to(self.dtype)
        heads = self._permuted_heads(tensor.name)
        return value if heads is None else unpermute_qk(value, heads)

    def _pack(self, tensor: ReaderTensor) -> PackedWeight:
        from statelm.kernels.quant import pack_gguf

        out_features, in_features = (int(d) for d in reversed(tensor.shape.tolist()))
        weight = pack_gguf(tensor.tensor_type, tensor.data, (out_features, in_features))
        heads = self._permuted_heads(tensor.name)
        return weight if heads is None else weight.select_rows(unpermute_qk(torch.arange(out_features), heads))

    def _permuted_heads(self, name: str) -> int | None:
        """The head count llama.cpp permuted this tensor's rows by, or None when it did not."""
        part = _BLOCK_TENSOR.match(name)
        if self.config.architecture not in PERMUTED_QK_ARCHITECTURES or not part:
            return None
        if part.group(2) == "attn_q":
            return self.config.num_attention_heads
        return self.config.num_key_value_heads if part.group(2) == "attn_k" else None


def load_gguf(path: Path, dtype: torch.dtype = torch.float32) -> GGUFModel:
    """Open a GGUF file and read its config, tokenizer and fingerprint; weights are read by `tensors()`."""
    path = Path(path)
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError, IndexError, KeyError) as exc:
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from exc
    fields = {name: _field_value(field) for name, field in reader.fields.items()}
    _check_tensors(path, reader, str(fields.get("general.architecture", "")))
    try:
        tokenizer = Tokenizer.from_gguf_fields(fields)
    except TokenizerError as exc:
        raise GGUFError(f"{path}: {exc}") from exc
    return GGUFModel(
        path=path,
        config=_config(path, fields, reader, tokenizer),
        tokenizer=tokenizer,
        metadata_digest=metadata_digest(reader),
        dtype=dtype,
        reader=reader,
        fields=fields,
    )


def metadata_digest(reader: GGUFReader) -> str:
    """sha256 of the file's header: key/value metadata and tensor names, types, shapes and offsets."""
    return hashlib.sha256(memoryview(reader.data[: reader.data_offset])).hexdigest()


def _field_value(field: Any) -> Any:
    value = field.contents()
    return value.tolist() if isinstance(value, np.ndarray) else value


def _check_tensors(path: Path, reader: GGUFReader, arch: str) -> None:
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_QUANT_TYPES:
            raise GGUFError(
                f"{path}: tensor {tensor.name} has unsupported type {tensor.tensor_type.name}; supported: "
                + ", ".join(sorted(t.name for t in SUPPORTED_QUANT_TYPES))
            )
        if tensor.name not in _CONFIG_TENSORS:
            try:
                hf_tensor_name(tensor.name, arch)
            except GGUFError as exc:
                raise GGUFError(f"{path}: {exc}") from exc


def _dequantize(tensor: ReaderTensor) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = dequantize(tensor.data, tensor.tensor_type)
    return np.require(data, np.float32, ["C", "W"]).reshape(shape)


def _config(path: Path, fields: dict[str, Any], reader: GGUFReader, tokenizer: Tokenizer) -> ModelConfig:
    arch = str(fields.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: unsupported architecture {arch!r}; statelm runs {', '.join(SUPPORTED_ARCHITECTURES)}")

    def key(name: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{name}", default)

    names = {t.name for t in reader.tensors}
    try:
        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length") or hidden // heads)
        theta = float(key("rope.freq_base", 10000.0))
        eos_ids = sorted(tokenizer.eos_token_ids, key=lambda i: (i != _eos_id(fields), i))
        values: dict[str, Any] = {
            "architecture": arch,
            "vocab_size": int(key("vocab_size") or len(fields["tokenizer.ggml.tokens"])),
            "hidden_size": hidden,
            "intermediate_size": int(key("feed_forward_length")),
            "num_hidden_layers": int(key("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(key("attention.head_count_kv") or heads),
            "head_dim": head_dim,
            "max_position_embeddings": int(key("context_length", 2048)),
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": theta,
            "rope_scaling": complete_rope_scaling(
                longrope_scaling(key, _config_tensors(reader, LONGROPE_TENSORS))
                or _rope_scaling(fields, arch, reader, theta, head_dim),
                int(key("context_length", 2048)),
            ),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "qk_norm": arch == "qwen3" or "blk.0.attn_q_norm.weight" in names,
            "sliding_window": int(key("attention.sliding_window")) if key("attention.sliding_window") else None,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_ids": tuple(eos_ids),
        }
        return ModelConfig(**{**values, **gguf_variant_fields(arch, key, values)})
    except (KeyError, TypeError, ValueError) as exc:
        raise GGUFError(f"{path}: missing or malformed {arch} metadata ({exc!r})") from exc


def _config_tensors(reader: GGUFReader, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The named tensors' values (float32), empty unless the file has all of them."""
    found = {t.name: _dequantize(t) for t in reader.tensors if t.name in names}
    return found if len(found) == len(names) else {}


def _eos_id(fields: dict[str, Any]) -> int | None:
    value = fields.get("tokenizer.ggml.eos_token_id")
    return int(value) if value is not None else None


def _rope_scaling(
    fields: dict[str, Any], arch: str, reader: GGUFReader, theta: float, head_dim: int
) -> dict[str, Any] | None:
    kind = fields.get(f"{arch}.rope.scaling.type")
    factor = fields.get(f"{arch}.rope.scaling.factor")
    original = fields.get(f"{arch}.rope.scaling.original_context_length")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        return llama3_rope_scaling(_dequantize(freqs).reshape(-1), theta, head_dim, original or 8192)
    if kind in (None, "none") or factor is None:
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": float(factor)}
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def llama3_rope_scaling(rope_factors: np.ndarray, theta: float, head_dim: int, original_context: int) -> dict[str, Any]:
    """Recover Llama-3 `rope_scaling` from llama.cpp's baked `rope_freqs` tensor (per-frequency divisors).

    llama.cpp stores 1 for high frequencies, `factor` for low ones and `1 / ((1 - s) / factor + s)` between,
    where `s = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)` is
    linear in `1 / wavelen`; two points of that ramp give both freq factors.
    """
    factors = np.asarray(rope_factors, dtype=np.float64)
    factor = float(factors.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ratio = original_context * inv_freq / (2 * math.pi)  # original_context / wavelen
    ramp = (factors > 1 + 1e-4) & (factors < factor - 1e-4 * factor)
    low, high = 1.0, 4.0
    if factor > 1 and ramp.sum() >= 2:
        smooth = (factor / factors[ramp] - 1) / (factor - 1)
        slope, intercept = np.polyfit(ratio[ramp], smooth, 1)
        low = float(-intercept / slope)
        high = float(low + 1 / slope)
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": round(low, 4),
        "high_freq_factor": round(high, 4),
        "original_max_position_embeddings": int(original_context),
    }
