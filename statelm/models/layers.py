"""Building blocks of Llama-family decoders: RMSNorm, rotary position embedding, gated MLP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from statelm.models.rope import attention_factor, rope_inv_freq

_INITIAL_ROPE_POSITIONS = 4096


@dataclass
class RopeInputs:
    """One forward's rope inputs: positions, and cos/sin rows (torch ops) or the whole table (kernels)."""

    positions: torch.Tensor
    interleaved: bool  # rotary pairs are adjacent dimensions (llama.cpp's layout), else halves (Hugging Face's)
    cos: torch.Tensor | None = None  # [T, 1, head_dim]
    sin: torch.Tensor | None = None
    table: torch.Tensor | None = None  # [P, 2, head_dim]


class LayerOps:
    """The element-wise work of a decoder layer in torch ops; KernelLayerOps fuses it in statelm's kernels."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension in float32, cast back before the weight, as Hugging Face does."""
        return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta in place, then its RMSNorm."""
        residual.add_(delta)
        return self.rms_norm(residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, for gate and up side by side in the last dimension."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def float_linear(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A small linear's projection of [T, in] rows (a mixture of experts' router), as the linear runs."""
        return linear(x)

    def expert_sum(self, rows: torch.Tensor, pairs: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
        """Each token's experts' outputs times their router weights, summed from zero in slot order: rows
        [T * top_k, H] in expert order, pairs [T * top_k] each row's token * top_k + slot, weights [T * top_k] each
        (token, slot)'s."""
        contributions = torch.empty_like(rows)
        contributions[pairs] = rows * weights[pairs, None]
        per_token = contributions.view(-1, top_k, rows.shape[1])
        out = torch.zeros_like(per_token[:, 0])
        for slot in range(top_k):  # from zero, in ascending expert order
            out += per_token[:, slot]
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate, tanh approximation) * up, for gate and up side by side in the last dimension (GeGLU)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def prepare_rope(self, positions: torch.Tensor, max_position: int, rotary: RotaryEmbedding) -> RopeInputs:
        """What rope() needs for one forward's tokens, computed once for all layers."""
        cos, sin = rotary.cos_sin(positions, max_position)
        return RopeInputs(positions, rotary.interleaved, cos=cos, sin=sin)

    def rope(self, q: torch.Tensor, k: torch.Tensor, inputs: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [T, heads, head_dim] rotated by their tokens' positions."""
        cos, sin = inputs.cos, inputs.sin
        assert cos is not None and sin is not None
        return apply_rope(q, cos, sin, inputs.interleaved), apply_rope(k, cos, sin, inputs.interleaved)


class KernelLayerOps(LayerOps):
    """LayerOps through statelm's fused float32 C++ kernels: fewer calls per layer, same math row by row."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of x (any leading shape)."""
        return torch.ops.statelm.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta in place, then its RMSNorm, in one pass."""
        return torch.ops.statelm.add_rms_norm_(residual, delta, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up in one pass."""
        return torch.ops.statelm.silu_mul(gate_up)

    def float_linear(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One fixed-order dot product an output (torch.ops.statelm.float_linear: no row chunks to pad, the weight
        read once) for a float32 RowChunkedLinear without bias; any other linear (a packed router) as it runs."""
        if not kernel_float_linear(linear):
            return linear(x)
        return torch.ops.statelm.float_linear(x.float().contiguous(), linear.weight)

    def expert_sum(self, rows: torch.Tensor, pairs: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
        """The same sums in one pass (torch.ops.statelm.expert_sum) for float32 rows."""
        if rows.dtype != torch.float32 or weights.dtype != torch.float32:
            return super().expert_sum(rows, pairs, weights, top_k)
        return torch.ops.statelm.expert_sum(rows.contiguous(), pairs.contiguous(), weights.contiguous(), top_k)

    def prepare_rope(self, positions: torch.Tensor, max_position: int, rotary: RotaryEmbedding) -> RopeInputs:
        """The tokens' positions and the whole table (the kernel looks rows up itself)."""
        return RopeInputs(positions, rotary.interleaved, table=rotary.table_for(positions, max_position))

    def rope(self, q: torch.Tensor, k: torch.Tensor, inputs: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated in place."""
        torch.ops.statelm.rope_(q, inputs.positions, inputs.table, inputs.interleaved)
        torch.ops.statelm.rope_(k, inputs.positions, inputs.table, inputs.interleaved)
        return q, k


def kernel_float_linear(linear: nn.Module) -> bool:
    """Whether torch.ops.statelm.float_linear computes the linear on the kernels path: a float32 RowChunkedLinear
    without bias."""
    return isinstance(linear, RowChunkedLinear) and linear.bias is None and linear.weight.dtype == torch.float32


class RMSNorm(nn.Module):
    """Root-mean-square norm's weight and epsilon; the model's LayerOps computes it."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)


class RotaryEmbedding:
    """Table of rope cos/sin per position (grown lazily), in Hugging Face's rotate-half layout (frequency i rotates
    dimensions i and i + head_dim / 2) or, interleaved, in llama.cpp's (dimensions 2i and 2i + 1)."""

    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any] | None, dtype: torch.dtype, interleaved: bool = False
    ) -> None:
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.attention_factor = attention_factor(scaling)  # cos and sin are multiplied by it (models/rope.py)
        self.dtype = dtype
        self.interleaved = interleaved
        self.table = torch.empty(0, 2, head_dim, dtype=dtype)

    def table_for(self, positions: torch.Tensor, max_position: int) -> torch.Tensor:
        """The [P, 2, head_dim] table of cos and sign-folded sin, grown to cover max_position."""
        if max_position > self.table.shape[0] or self.table.device != positions.device:
            self._build(max(max_position, _INITIAL_ROPE_POSITIONS), positions.device)
        return self.table

    def cos_sin(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, each [T, 1, head_dim], for positions all below max_position."""
        rows = self.table_for(positions, max_position).index_select(0, positions)
        return rows[:, 0:1], rows[:, 1:2]

    def _build(self, num_positions: int, device: torch.device) -> None:
        size = 1 << (num_positions - 1).bit_length()
        inv_freq = self.inv_freq.to(device)
        freqs = torch.outer(torch.arange(size, device=device, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if self.interleaved:  # dimension 2i: x cos - y sin, 2i + 1: y cos + x sin
            cos = cos.repeat_interleave(2, dim=-1)
            sin = torch.stack([-sin, sin], dim=-1).flatten(-2)
        else:  # dimension i: x cos - y sin, i + half: y cos + x sin
            cos = torch.cat([cos, cos], dim=-1)
            sin = torch.cat([-sin, sin], dim=-1)
        table = torch.stack([cos, sin], dim=1)
        if self.attention_factor != 1.0:
            table = table * self.attention_factor
        self.table = table.to(self.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x * cos + partner(x) * sin: the other dimension of each rotary pair (the sign folded into signed_sin)."""
    if interleaved:
        return x * cos + x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * signed_sin
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, row_chunk: int) -> torch.Tensor:
    """x @ weight.T (+ bias), computed in calls of exactly row_chunk rows (zero-padded) when row_chunk > 0.

    CPU GEMM kernels pick their blocking, and so their rounding, from the number of rows. Fixed-size calls
    make each row's result independent of how many other rows share the batch; 0 means one call.
    """
    rows = x.shape[0]
    if row_chunk <= 0:
        return F.linear(x, weight, bias)
    padding = -rows % row_chunk
    if padding:
        x = torch.cat([x, x.new_zeros(padding, x.shape[1])])
    if rows <= row_chunk:
        return F.linear(x, weight, bias)[:rows]
    out = x.new_empty(rows + padding, weight.shape[0])
    for start in range(0, rows + padding, row_chunk):
        out[start : start + row_chunk] = F.linear(x[start : start + row_chunk], weight, bias)
    return out[:rows]


def split_rows(
    is_prompt: torch.Tensor | None, device: torch.device | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Indices (on device, default is_prompt's) of the prompt rows and the generated rows marked by is_prompt; the
    prompt rows None when there are none (is_prompt None: all generated), the generated rows None when all are
    prompt rows."""
    if is_prompt is None or not bool(is_prompt.any()):
        return None, None
    device = device or is_prompt.device
    if bool(is_prompt.all()):
        return torch.arange(is_prompt.numel(), device=device), None
    return is_prompt.nonzero().squeeze(1).to(device), (~is_prompt).nonzero().squeeze(1).to(device)


@dataclass
class RowChunking:
    """How a model's linears split rows into fixed-size matmul calls, for batch-invariant output.

    Rows of generated tokens go in small chunks (decode is mostly one row per sequence), rows of prompt
    tokens in large ones (prefill efficiency). A row's kind never depends on its neighbours, and a
    generated token recomputed after preemption is still a generated row, so every row's result is the
    same whatever batch it is in. Chunk sizes of 0 turn this off (one call over all rows).
    """

    generated: int = 0
    prompt: int = 0
    prompt_rows: torch.Tensor | None = None  # set for one forward: indices of prompt-token rows
    generated_rows: torch.Tensor | None = None

    @classmethod
    def batch_invariant(cls, device: torch.device | None = None) -> RowChunking:
        """Chunk sizes by device, each about the most rows a call takes for the price of one.

        CPU: 16 rows for generated tokens (also the fastest bf16 decode shape on AMX CPUs), 128 for prompts.
        CUDA: a matmul stays bound by reading its weights up to a few hundred rows on an H100, so 128 generated
        rows cost about what one does (a decode batch of up to 128 reads the weights once), and 512 prompt rows
        keep prefill compute-bound.
        """
        if device is not None and device.type == "cuda":
            return cls(generated=128, prompt=512)
        return cls(generated=16, prompt=128)

    @classmethod
    def per_row(cls) -> RowChunking:
        """Every row in a call of its own: invariant whatever the kernels do, and slow."""
        return cls(generated=1, prompt=1)

    @property
    def enabled(self) -> bool:
        """Whether rows are chunked at all (batch invariance asked for)."""
        return self.generated > 0 or self.prompt > 0

    def resize(self, sizes: RowChunking) -> None:
        """Take the chunk sizes of another RowChunking (the model's linears share this object)."""
        self.generated, self.prompt = sizes.generated, sizes.prompt

    def set_rows(self, is_prompt: torch.Tensor | None, device: torch.device | None = None) -> None:
        """Record which rows of the coming forward hold prompt tokens (None: all generated).

        The row indices go to `device` (default: is_prompt's); a host is_prompt costs the GPU no sync.
        """
        self.prompt_rows, self.generated_rows = split_rows(is_prompt, device)

    def rows_among(self, rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(prompt rows, generated rows) of a subset of this forward's rows (indices into the batch), as indices
        into the subset, None as set_rows records them (an expert's share of a batch, models/moe.py)."""
        if self.prompt_rows is None:
            return None, None
        return split_rows(torch.isin(rows, self.prompt_rows))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The projection of [T, in] rows, each kind of row in its own chunk size."""
        if self.prompt_rows is None:
            return chunked_linear(x, weight, bias, self.generated)
        if self.generated_rows is None:
            return chunked_linear(x, weight, bias, self.prompt)
        out = x.new_empty(x.shape[0], weight.shape[0])
        out[self.generated_rows] = chunked_linear(x[self.generated_rows], weight, bias, self.generated)
        out[self.prompt_rows] = chunked_linear(x[self.prompt_rows], weight, bias, self.prompt)
        return out


class RowChunkedLinear(nn.Linear):
    """nn.Linear whose matmul follows the model's RowChunking."""

    def __init__(self, *args: object, chunking: RowChunking, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.chunking = chunking

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the projection to [T, in_features]."""
        return self.chunking.linear(x, self.weight, self.bias)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(
        self, hidden: int, intermediate: int, *, dtype: torch.dtype, device: torch.device | str, chunking: RowChunking
    ) -> None:
        super().__init__()
        self.intermediate = intermediate
        linear = {"bias": False, "dtype": dtype, "device": device, "chunking": chunking}
        self.gate_up_proj = RowChunkedLinear(hidden, 2 * intermediate, **linear)
        self.down_proj = RowChunkedLinear(intermediate, hidden, **linear)

    def targets(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        """Hugging Face names (relative to the layer's `mlp.`) of the projections, and the rows they fill."""
        gate_up, size = self.gate_up_proj.weight, self.intermediate
        return {
            "gate_proj.weight": (gate_up, 0, size),
            "up_proj.weight": (gate_up, size, 2 * size),
            "down_proj.weight": (self.down_proj.weight, 0, self.down_proj.weight.shape[0]),
        }

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """Apply the feed-forward block to [T, hidden]."""
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))
