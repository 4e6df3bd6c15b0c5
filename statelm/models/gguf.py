"""Read GGUF files: config and tokenizer from metadata; weights under Hugging Face names, dequantized or in place."""

from __future__ import annotations

import dataclasses
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
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tqdm import tqdm

from statelm.kernels.build import kernels_available
from statelm.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from statelm.models.gguf_file import GGUFFile, GGUFFormatError, GGUFHeader, TensorInfo
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
BLOCK_TYPES = frozenset(
    {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS}
)  # what statelm.kernels.quant reads in place (kept here so that loading a GGUF does not import the kernels)
SUPPORTED_QUANT_TYPES = BLOCK_TYPES | {Q.F32, Q.F16, Q.BF16}
# llama.cpp's converter interleaves the rows of Q/K for these architectures (rotary layout): a model whose weights
# stay in place rotates adjacent pairs as llama.cpp does (ModelConfig.rope_interleaved); a dequantized one has its
# rows put back in Hugging Face's order (unpermute_qk).
PERMUTED_QK_ARCHITECTURES = frozenset({"llama", "mistral", "granite", "mixtral"})
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
    """A GGUF file opened for loading: its config, tokenizer, fingerprint and (lazily) its weights.

    packed: quantized matrices are used in place (views of the mapped file) and Q/K rows stay in llama.cpp's
    order; else every tensor is dequantized to `dtype` in Hugging Face's layout.
    """

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    metadata_digest: str
    dtype: torch.dtype
    file: GGUFFile
    packed: bool

    @property
    def fields(self) -> dict[str, Any]:
        """The decoded key/value metadata."""
        return self.file.header.fields

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        """Yield `(hf_name, tensor)` pairs: packed weights in place, other tensors converted (with a progress bar
        on stderr when that takes a while: a dequantized model). A mixture of experts' 3-D expert stacks come
        packed as one block matrix of every expert's rows in turn (models/moe.py splits them per expert)."""
        weights = [info for info in self.file.header.tensors.values() if info.name not in _CONFIG_TENSORS]
        arch = self.config.architecture
        for info in tqdm(weights, desc="converting GGUF", unit="tensor", file=sys.stderr, disable=self.packed):
            name = hf_tensor_name(info.name, arch)
            if self.packed and info.qtype in BLOCK_TYPES and len(info.shape) >= 2:
                yield name, self._in_place(info)
            else:
                yield name, self._convert(info, name)

    def _convert(self, info: TensorInfo, hf_name: str) -> torch.Tensor:
        value = to_hf_values(self.config.architecture, hf_name, dequantized(self.file, info)).to(self.dtype)
        heads = None if self.config.rope_interleaved else self._permuted_heads(info.name)
        return value if heads is None else unpermute_qk(value, heads)

    def _in_place(self, info: TensorInfo) -> PackedWeight:
        return in_place(self.file, info)

    def _permuted_heads(self, name: str) -> int | None:
        """The head count llama.cpp permuted this tensor's rows by, or None when it did not."""
        part = _BLOCK_TENSOR.match(name)
        if self.config.architecture not in PERMUTED_QK_ARCHITECTURES or not part:
            return None
        if part.group(2) == "attn_q":
            return self.config.num_attention_heads
        return self.config.num_key_value_heads if part.group(2) == "attn_k" else None


def load_gguf(
    path: Path, dtype: torch.dtype = torch.float32, packed: bool = False, header: GGUFHeader | None = None
) -> GGUFModel:
    """Open a GGUF file and read its config, tokenizer and fingerprint; weights are read by `tensors()`.

    header: the file's header as parsed before (the model cache's), to skip parsing it again.
    """
    path = Path(path)
    try:
        file = GGUFFile(path, header)
    except (OSError, GGUFFormatError) as exc:
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from exc
    fields = file.header.fields
    _check_tensors(path, file, str(fields.get("general.architecture", "")))
    try:
        tokenizer = Tokenizer.from_gguf_fields(fields)
    except TokenizerError as exc:
        raise GGUFError(f"{path}: {exc}") from exc
    config = _config(path, fields, file, tokenizer)
    if packed and config.architecture in PERMUTED_QK_ARCHITECTURES:
        config = dataclasses.replace(config, rope_interleaved=True)
    return GGUFModel(path, config, tokenizer, metadata_digest(file), dtype, file, packed)


def metadata_digest(file: GGUFFile) -> str:
    """sha256 of the file's header: key/value metadata and tensor names, types, shapes and offsets."""
    return hashlib.sha256(file.header_bytes).hexdigest()


def _check_tensors(path: Path, file: GGUFFile, arch: str) -> None:
    for tensor in file.header.tensors.values():
        if tensor.qtype not in SUPPORTED_QUANT_TYPES:
            raise GGUFError(
                f"{path}: tensor {tensor.name} has unsupported type {tensor.qtype.name}; supported: "
                + ", ".join(sorted(t.name for t in SUPPORTED_QUANT_TYPES))
            )
        if tensor.name not in _CONFIG_TENSORS:
            try:
                hf_tensor_name(tensor.name, arch)
            except GGUFError as exc:
                raise GGUFError(f"{path}: {exc}") from exc


def in_place(file: GGUFFile, info: TensorInfo) -> PackedWeight:
    """A tensor in a block format as a packed weight viewing the mapped file (no copy): its rows are the last
    dimension's, the leading dimensions flattened (a mixture of experts' [experts, rows, columns] stacks them)."""
    from statelm.kernels.quant import BlockMatrix, PackedWeight

    shape = (math.prod(info.shape[:-1]), info.shape[-1])
    return PackedWeight([BlockMatrix.of(info.qtype, file.raw(info), shape, mapped=True)])


def dequantized(file: GGUFFile, info: TensorInfo) -> torch.Tensor:
    """A tensor of the file in float32, gguf-py's values: a block matrix or stack of them by statelm's kernel (on
    every core) where the kernels are built, anything else by gguf-py; a float32 tensor views the mapped file."""
    if info.qtype in BLOCK_TYPES and len(info.shape) >= 2 and kernels_available():
        return in_place(file, info).dequantize().reshape(info.shape)
    return torch.from_numpy(_dequantize(file, info))


def _dequantize(file: GGUFFile, info: TensorInfo) -> np.ndarray:
    data = dequantize(file.array(info), info.qtype)
    return np.require(data, np.float32, ["C", "W"]).reshape(info.shape)


def _config(path: Path, fields: dict[str, Any], file: GGUFFile, tokenizer: Tokenizer) -> ModelConfig:
    arch = str(fields.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: unsupported architecture {arch!r}; statelm runs {', '.join(SUPPORTED_ARCHITECTURES)}")

    def key(name: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{name}", default)

    names = set(file.header.tensors)
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
                longrope_scaling(key, _config_tensors(file, LONGROPE_TENSORS))
                or _rope_scaling(fields, arch, file, theta, head_dim),
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


def _config_tensors(file: GGUFFile, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The named tensors' values (float32), empty unless the file has all of them."""
    found = {name: _dequantize(file, file.header.tensors[name]) for name in names if name in file.header.tensors}
    return found if len(found) == len(names) else {}


def _eos_id(fields: dict[str, Any]) -> int | None:
    value = fields.get("tokenizer.ggml.eos_token_id")
    return int(value) if value is not None else None


def _rope_scaling(
    fields: dict[str, Any], arch: str, file: GGUFFile, theta: float, head_dim: int
) -> dict[str, Any] | None:
    kind = fields.get(f"{arch}.rope.scaling.type")
    factor = fields.get(f"{arch}.rope.scaling.factor")
    original = fields.get(f"{arch}.rope.scaling.original_context_length")
    freqs = file.header.tensors.get("rope_freqs.weight")
    if freqs is not None:
        return llama3_rope_scaling(_dequantize(file, freqs).reshape(-1), theta, head_dim, original or 8192)
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
