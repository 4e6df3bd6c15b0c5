"""Tiny random Llama-family GGUF models whose matrices are in one given block format, for tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from tests.models.test_gguf import write_gguf
from tests.unit.gguf_blocks import random_blocks

SIZES = {"hidden": 256, "ffn": 512, "heads": 4, "kv_heads": 2, "layers": 2}
QUANTIZABLE = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1})  # gguf-py quantizes these; others: random blocks


def _matrix(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, Q | None]:
    if qtype == Q.F32:
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), None
    if qtype in QUANTIZABLE:
        return quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype), qtype
    # a K-quant's weight is d * sub-scale (up to 63) * level: small d keeps the weights near 0.05
    small = (2e-5, 1e-4) if GGML_QUANT_SIZES[qtype][0] == 256 else (0.002, 0.01)
    return random_blocks(qtype, rows, cols, rng, small), qtype


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
