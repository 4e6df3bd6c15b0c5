"""Reference attention backend in plain PyTorch: paged KV gather + scaled_dot_product_attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from statelm.engine.attention.base import AttentionMetadata


@dataclass
class _DecodeGroup:
    """Sequences with a single query token, attended in one batched call."""

    rows: torch.Tensor | None  # flat-batch index of each decode token; None when every token is a decode
    blocks: torch.Tensor  # [num_seqs * num_blocks] block ids, row-major per sequence
    num_seqs: int
    num_blocks: int
    ctx: int  # longest context in the group
    mask: torch.Tensor | None  # [num_seqs, 1, 1, ctx] bool, None when every key is visible


@dataclass
class _PrefillSeq:
    """One sequence with several query tokens (a prompt or a chunk of one)."""

    start: int
    end: int
    seq_len: int
    blocks: torch.Tensor | None  # block ids of its context; None when the context is only this step's tokens
    mask: torch.Tensor | None  # [query_len, seq_len] bool; None means plain causal


@dataclass
class _Plan:
    """How one step's batch is split into attention calls; shared by every layer of the step."""

    decode: _DecodeGroup | None
    prefills: list[_PrefillSeq]


class _GatherBuffers:
    """Reused output buffers for gathering cache blocks, so large gathers do not fault in fresh pages."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def gather(self, cache: torch.Tensor, blocks: torch.Tensor, name: str) -> torch.Tensor:
        """cache[blocks] as [n, block_size, kv_heads, head_dim]; valid until the next gather into name."""
        shape = (blocks.shape[0], *cache.shape[1:])
        numel = shape[0] * cache[0].numel()
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != cache.dtype
            or buffer.device != cache.device
        ):
            buffer = torch.empty(numel, dtype=cache.dtype, device=cache.device)
            self._buffers[name] = buffer
        return torch.index_select(cache, 0, blocks, out=buffer[:numel].view(shape))


class TorchAttentionBackend:
    """Paged attention on any torch device; one batched SDPA for decodes, one SDPA per prefilling sequence."""

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window
        self._plan_meta: AttentionMetadata | None = None
        self._plan: _Plan | None = None
        self._buffers = _GatherBuffers()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend each query over its sequence's context."""
        kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        plan = self._plan_for(meta, k_cache.shape[1])
        if plan.decode is not None and plan.decode.rows is None:
            return _decode(q, k_cache, v_cache, plan.decode, scale, self._buffers)
        if (
            plan.decode is None
            and len(plan.prefills) == 1
            and plan.prefills[0].end - plan.prefills[0].start == len(q)
        ):
            return _prefill(q, (k, v), (k_cache, v_cache), plan.prefills[0], scale, self._buffers)
        out = torch.empty_like(q)
        if plan.decode is not None and plan.decode.rows is not None:
            out.index_copy_(
                0, plan.decode.rows, _decode(q, k_cache, v_cache, plan.decode, scale, self._buffers)
            )
        for seq in plan.prefills:
            out[seq.start : seq.end] = _prefill(q, (k, v), (k_cache, v_cache), seq, scale, self._buffers)
        return out

    def _plan_for(self, meta: AttentionMetadata, block_size: int) -> _Plan:
        """Build the plan on a step's first layer, reuse it for the rest (keyed by the metadata object)."""
        if meta is not self._plan_meta or self._plan is None:
            self._plan = self._build_plan(meta, block_size)
            self._plan_meta = meta
        return self._plan

    def _build_plan(self, meta: AttentionMetadata, block_size: int) -> _Plan:
        decodes = [i for i, n in enumerate(meta.query_lens) if n == 1]
        prefills = [self._prefill_seq(meta, i, block_size) for i, n in enumerate(meta.query_lens) if n > 1]
        decode = self._decode_group(meta, decodes, block_size) if decodes else None
        return _Plan(decode=decode, prefills=prefills)

    def _decode_group(self, meta: AttentionMetadata, seqs: list[int], block_size: int) -> _DecodeGroup:
        device = meta.block_tables.device
        seq_lens = [meta.seq_lens[i] for i in seqs]
        ctx = max(seq_lens)
        num_blocks = -(-ctx // block_size)
        if len(seqs) == len(meta.query_lens):
            rows, tables = None, meta.block_tables[:, :num_blocks]
        else:
            rows = torch.tensor([meta.query_start[i] for i in seqs], device=device)
            tables = meta.block_tables[torch.tensor(seqs, device=device), :num_blocks]
        mask = None
        if min(seq_lens) != ctx or self._window_applies(ctx):
            lens = torch.tensor(seq_lens, device=device).view(-1, 1)
            key_pos = torch.arange(ctx, device=device).view(1, -1)
            visible = key_pos < lens
            if self.sliding_window is not None:
                visible &= key_pos >= lens - self.sliding_window
            mask = visible.view(len(seqs), 1, 1, ctx)
        return _DecodeGroup(rows, tables.reshape(-1), len(seqs), num_blocks, ctx, mask)

    def _prefill_seq(self, meta: AttentionMetadata, i: int, block_size: int) -> _PrefillSeq:
        start, end, seq_len = meta.query_start[i], meta.query_start[i + 1], meta.seq_lens[i]
        query_len = end - start
        blocks = None
        if query_len != seq_len:
            blocks = meta.block_tables[i, : -(-seq_len // block_size)]
        mask = None
        if query_len != seq_len or self._window_applies(seq_len):
            device = meta.block_tables.device
            query_pos = torch.arange(seq_len - query_len, seq_len, device=device).view(-1, 1)
            key_pos = torch.arange(seq_len, device=device).view(1, -1)
            mask = key_pos <= query_pos
            if self.sliding_window is not None:
                mask &= key_pos > query_pos - self.sliding_window
        return _PrefillSeq(start, end, seq_len, blocks, mask)

    def _window_applies(self, ctx: int) -> bool:
        return self.sliding_window is not None and ctx > self.sliding_window


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: _DecodeGroup,
    scale: float,
    buffers: _GatherBuffers,
) -> torch.Tensor:
    """Attention for single-token queries; query heads are grouped per KV head, so no K/V expansion."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    if group.rows is not None:
        q = q.index_select(0, group.rows)
    q = q.reshape(group.num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    shape = (group.num_seqs, -1, kv_heads, head_dim)
    keys = buffers.gather(k_cache, group.blocks, "k").view(shape)[:, : group.ctx].transpose(1, 2)
    values = buffers.gather(v_cache, group.blocks, "v").view(shape)[:, : group.ctx].transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.mask, scale=scale)
    return out.reshape(group.num_seqs, num_heads, head_dim)


def _prefill(
    q: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    seq: _PrefillSeq,
    scale: float,
    buffers: _GatherBuffers,
) -> torch.Tensor:
    """Causal attention of one sequence's query tokens over its whole context."""
    if seq.blocks is None:
        keys, values = (t[seq.start : seq.end] for t in new_kv)
    else:
        keys, values = (
            buffers.gather(cache, seq.blocks, name).flatten(0, 1)[: seq.seq_len]
            for cache, name in zip(kv_cache, "kv", strict=True)
        )
    out = F.scaled_dot_product_attention(
        q[seq.start : seq.end].transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=seq.mask,
        is_causal=seq.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)
