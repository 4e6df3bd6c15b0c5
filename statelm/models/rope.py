"""Rope scalings that change the frequencies and the magnitude of cos/sin: YaRN (Qwen2.5's long context) and
LongRoPE (Phi-3's `longrope`, formerly `su`), computed as transformers computes them.

A scaling's `attention_factor` multiplies cos and sin, and so every attention score by its square. LongRoPE's
factor sets (short and long) are chosen once per model, as llama.cpp chooses them: the long set when the model's
context (max_position_embeddings) exceeds original_max_position_embeddings. transformers chooses per forward by the
longest position in it, which would make a token's keys depend on when they were computed; with one set per model
a session's KV and a batch's rows stay exact. Up to original_max_position_embeddings positions and for models
whose context is the original one, the two agree.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from statelm.models.variant_config import ModelConfigError

SCALED_KINDS = ("yarn", "longrope", "su")


def complete_rope_scaling(scaling: dict[str, Any] | None, max_positions: int) -> dict[str, Any] | None:
    """A YaRN or LongRoPE scaling with its defaults filled from the model's context (others as they are)."""
    if scaling is None or scaling.get("rope_type") not in SCALED_KINDS:
        return scaling
    scaling = {**scaling, "rope_type": "longrope" if scaling["rope_type"] == "su" else scaling["rope_type"]}
    original = int(scaling.get("original_max_position_embeddings") or max_positions)
    scaling["original_max_position_embeddings"] = original
    if scaling.get("factor") is None:
        scaling["factor"] = max_positions / original
    if scaling["rope_type"] == "longrope":
        scaling["use_long_factors"] = max_positions > original
    return scaling


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with optional linear, llama3, yarn or longrope scaling (the
    last two completed by complete_rope_scaling)."""
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return 1.0 / base
    assert scaling is not None
    if kind == "linear":
        return 1.0 / base / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(1.0 / base, scaling)
    if kind == "longrope":
        factors = scaling["long_factor"] if scaling.get("use_long_factors") else scaling["short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base)
    if kind == "yarn":
        return _yarn_inv_freq(base, head_dim, theta, scaling)
    raise ModelConfigError(
        f"unsupported rope_scaling type {kind!r}; statelm supports default, linear, llama3, yarn, longrope"
    )


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: 1 but for YaRN and LongRoPE (their own value, else their formula)."""
    kind = (scaling or {}).get("rope_type")
    if kind not in SCALED_KINDS:
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if kind == "yarn":
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(pos_freqs: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolated (divided by factor) low frequencies, extrapolated high ones, a linear ramp between."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` in the context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.get("beta_fast") or 32), dimension(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent rope scaling (low frequencies divided by factor, smooth in between)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
