"""The KV cache's storage formats (float32, float16, bfloat16, q8_0), their row form and exact conversions.

A format says how one token's K (or V) of one KV head, head_dim values, is kept:

- float32, float16, bfloat16: the values rounded to that dtype (round to nearest even);
- q8_0 (llama.cpp's block format): per 32 consecutive values, one float16 scale d = fp16(max|x| / 127) and 32 int8
  q = x / d rounded to nearest even and clamped to ±127 (0 where d is 0); a value reads back as d * q, which
  float32 holds exactly (11 by 7 significant bits), so reading it is exact whatever does the reading.

Every format is computed from the model's K/V one token at a time, so a token's stored K/V never depends on the
others stored with it: prefill and decode, whole and chunked, store the same bits.

Outside the pool (sessions exported, spilled, snapshotted) K and V are kept as rows, per layer a tensor of
[tokens, kv_heads, width]: float formats as [tokens, heads, head_dim] of their dtype, q8_0 as llama.cpp's
block_q8_0 bytes, [tokens, heads, head_dim / 32 * 34] uint8 (each block the scale's two bytes, then 32 int8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Q8_GROUP = 32  # values per q8_0 block
Q8_BLOCK_BYTES = 2 + Q8_GROUP  # float16 scale, then the int8 values
Q8_MAX = 127.0


@dataclass(frozen=True)
class KVFormat:
    """How K/V values are stored: `element` is the dtype of the stored values (int8 for q8_0)."""

    name: str
    element: torch.dtype

    @property
    def quantized(self) -> bool:
        """True for q8_0 (values and a scale per 32 of them)."""
        return self.element == torch.int8

    @property
    def row_dtype(self) -> torch.dtype:
        """The dtype of this format's rows outside the pool."""
        return torch.uint8 if self.quantized else self.element

    def bytes_per_value(self) -> float:
        """Bytes one K or V value takes, its share of the scale included."""
        if self.quantized:
            return Q8_BLOCK_BYTES / Q8_GROUP
        return torch.empty((), dtype=self.element).element_size()

    def row_width(self, head_dim: int) -> int:
        """Elements of one token's row of one KV head outside the pool."""
        return head_dim // Q8_GROUP * Q8_BLOCK_BYTES if self.quantized else head_dim

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token's K and V take across all layers."""
        return int(2 * num_layers * num_kv_heads * head_dim * self.bytes_per_value())

    def check_head_dim(self, head_dim: int) -> None:
        """ValueError unless this format can store heads of head_dim values."""
        if self.quantized and head_dim % Q8_GROUP:
            raise ValueError(
                f"a q8_0 KV cache needs a head dim that is a multiple of {Q8_GROUP} (this one is {head_dim})"
            )


FORMATS = {
    "float32": KVFormat("float32", torch.float32),
    "float16": KVFormat("float16", torch.float16),
    "bfloat16": KVFormat("bfloat16", torch.bfloat16),
    "q8_0": KVFormat("q8_0", torch.int8),
}
FLOAT_FORMATS = {fmt.element: fmt for fmt in FORMATS.values() if not fmt.quantized}


def kv_format(spec: str | torch.dtype | KVFormat) -> KVFormat:
    """The format of a name (`q8_0`, `float16` ...), a float dtype, or a format itself."""
    if isinstance(spec, KVFormat):
        return spec
    if isinstance(spec, torch.dtype):
        if spec not in FLOAT_FORMATS:
            raise ValueError(f"no KV format stores {spec}")
        return FLOAT_FORMATS[spec]
    if spec not in FORMATS:
        raise ValueError(f"unknown KV cache dtype {spec!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[spec]


def format_of_rows(rows: torch.Tensor) -> KVFormat:
    """The format a row tensor is in (uint8 rows are q8_0 blocks)."""
    return FORMATS["q8_0"] if rows.dtype == torch.uint8 else kv_format(rows.dtype)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [..., D], float16 scales [..., D / 32]) of x [..., D], as the kernels quantize it."""
    groups = x.float().unflatten(-1, (-1, Q8_GROUP))
    scales = (groups.abs().amax(-1) / Q8_MAX).to(torch.float16)
    divisor = scales.float().unsqueeze(-1)
    values = torch.where(divisor == 0, 0.0, (groups / divisor).round().clamp(-Q8_MAX, Q8_MAX))
    return values.to(torch.int8).flatten(-2), scales


def dequantize_q8_0(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 d * q of int8 values [..., D] and float16 scales [..., D / 32] (exact)."""
    groups = values.float().unflatten(-1, (-1, Q8_GROUP))
    return (groups * scales.float().unsqueeze(-1)).flatten(-2)


def pack_q8_0(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """block_q8_0 bytes [..., D / 32 * 34] of int8 values [..., D] and float16 scales [..., D / 32]."""
    blocks = values.view(torch.uint8).unflatten(-1, (-1, Q8_GROUP))
    scale_bytes = scales.contiguous().view(torch.uint8).unflatten(-1, (-1, 2))
    return torch.cat((scale_bytes, blocks), -1).flatten(-2)


def unpack_q8_0(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float16 scales) of block_q8_0 bytes [..., G * 34]."""
    blocks = rows.unflatten(-1, (-1, Q8_BLOCK_BYTES))
    scales = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1)
    values = blocks[..., 2:].contiguous().view(torch.int8).flatten(-2)
    return values, scales


def encode_rows(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Rows of fmt from K or V values x [tokens, heads, head_dim] (rounded or quantized, as the pool stores them)."""
    if fmt.quantized:
        return pack_q8_0(*quantize_q8_0(x))
    return x.to(fmt.element)


def decode_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values [tokens, heads, head_dim] that rows hold, in dtype (exact where dtype can hold them)."""
    if rows.dtype == torch.uint8:
        return dequantize_q8_0(*unpack_q8_0(rows)).to(dtype)
    return rows.to(dtype)
