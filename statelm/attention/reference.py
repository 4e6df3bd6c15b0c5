"""Reference attention backend in plain PyTorch: paged KV gather + scaled_dot_product_attention.

Batch invariance: a query row's result must not depend on which other sequences share the step, how its
prompt was split into prefill chunks, or whether it is decoded or recomputed after preemption. The CPU
SDPA kernel's reductions depend on the key length, so every call sees keys zero-padded to a multiple of
KEY_PAD with an explicit mask; padded keys contribute exactly zero, so the result of a row then depends
only on its own visible keys. The kernel's path also depends on the query layout and on a single
query row versus several: queries are always passed in one contiguous layout, and single-row calls
(decodes, or a prompt whose prefix but one token came from the cache) send their row twice and drop the
copy. A row's result is then the same whatever the number of query rows in its call, on CPUs whose SDPA
kernel keeps that promise (AMX ones do; AVX2 ones do not). `per_row` makes every query row a call of its
own (as a decode at its position): slow for prefills, but invariant on any CPU; the start-up self-check
(statelm.models.invariance) falls back to it when nothing faster passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from statelm.attention.base import AttentionMetadata
from statelm.attention.layer_kv import LayerKV

KEY_PAD = 64
DECODE_QUERY_ROWS = 2  # the fewest query rows that take the same SDPA path as a prefill
SOFTCAP_QUERY_ROWS = 16  # query rows per matmul of soft-capped attention (a fixed count: see _softcapped_attention)


@dataclass
class _Call:
    """One SDPA call: some sequences' query rows over their gathered, padded context."""

    rows: torch.Tensor | slice  # the query tokens' rows in the flat batch
    blocks: torch.Tensor  # [num_seqs * blocks_per_seq] cache blocks, row-major per sequence
    num_seqs: int
    num_keys: int  # padded context length (a multiple of KEY_PAD)
    mask: torch.Tensor  # [num_seqs, 1, query_len, num_keys] bool: which keys each query sees


class TorchAttentionBackend:
    """Paged attention on any torch device: all decodes in one call, one call per prefilling sequence."""

    def __init__(self, sliding_window: int | None = None, per_row: bool = False, softcap: float | None = None) -> None:
        self.sliding_window = sliding_window
        self.per_row = per_row
        self.softcap = softcap  # scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2)
        self._plan_meta: AttentionMetadata | None = None
        self._plan: list[_Call] = []

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache (rounded or quantized), then attend each query over its context."""
        cache.store(k, v, meta.slot_mapping)
        calls = self._plan_for(meta, cache.block_size)
        if len(calls) == 1 and isinstance(calls[0].rows, slice):
            return _attend(q, cache, calls[0], scale, self.softcap)
        out = torch.empty_like(q)
        for call in calls:
            out[call.rows] = _attend(q, cache, call, scale, self.softcap)
        return out

    def _plan_for(self, meta: AttentionMetadata, block_size: int) -> list[_Call]:
        """Build the calls on a step's first layer and reuse them for the rest (keyed by the metadata object)."""
        if meta is not self._plan_meta:
            self._plan = self._build_plan(meta, block_size)
            self._plan_meta = meta
        return self._plan

    def _build_plan(self, meta: AttentionMetadata, block_size: int) -> list[_Call]:
        if self.per_row:
            return [
                self._call(meta, [i], block_size, context=meta.seq_lens[i] - meta.query_lens[i] + j + 1)
                for i, n in enumerate(meta.query_lens)
                for j in range(n)
            ]
        decodes = [i for i, n in enumerate(meta.query_lens) if n == 1]
        calls = [self._call(meta, decodes, block_size)] if decodes else []
        calls += [self._call(meta, [i], block_size) for i, n in enumerate(meta.query_lens) if n > 1]
        return calls

    def _call(self, meta: AttentionMetadata, seqs: list[int], block_size: int, context: int | None = None) -> _Call:
        """One call for seqs, which all have the same query length (1 for a decode group).

        context: attend only the query row at this context length (per-row mode; seqs is then one sequence).
        """
        device = meta.block_tables.device
        seq_lens = torch.tensor([context or meta.seq_lens[i] for i in seqs], device=device)
        query_len = 1 if context else meta.query_lens[seqs[0]]
        num_keys = -(-int(seq_lens.max()) // KEY_PAD) * KEY_PAD
        blocks_per_seq = -(-num_keys // block_size)
        tables = meta.block_tables[torch.tensor(seqs, device=device)]
        if tables.shape[1] < blocks_per_seq:  # padding keys read block 0; the mask hides them
            tables = F.pad(tables, (0, blocks_per_seq - tables.shape[1]))
        query_pos = seq_lens.view(-1, 1, 1) - query_len + torch.arange(query_len, device=device).view(1, -1, 1)
        if query_len == 1:
            query_pos = query_pos.expand(-1, DECODE_QUERY_ROWS, -1)
        key_pos = torch.arange(num_keys, device=device).view(1, 1, -1)
        mask = key_pos <= query_pos
        if self.sliding_window is not None:
            mask &= key_pos > query_pos - self.sliding_window
        if context:
            row = meta.query_start[seqs[0]] + context - (meta.seq_lens[seqs[0]] - meta.query_lens[seqs[0]]) - 1
            rows: torch.Tensor | slice = torch.tensor([row], device=device)
        elif len(seqs) == len(meta.query_lens):
            rows = slice(None)
        elif query_len == 1:
            rows = torch.tensor([meta.query_start[i] for i in seqs], device=device)
        else:
            rows = slice(meta.query_start[seqs[0]], meta.query_start[seqs[0] + 1])
        return _Call(rows, tables[:, :blocks_per_seq].reshape(-1), len(seqs), num_keys, mask.unsqueeze(1))


def _attend(q: torch.Tensor, cache: LayerKV, call: _Call, scale: float, softcap: float | None) -> torch.Tensor:
    """SDPA of the call's query rows [rows, heads, dim] over their padded contexts; returns the same shape."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = cache.v.shape[1]
    query = q[call.rows].view(call.num_seqs, -1, num_heads, head_dim)
    query_len = query.shape[1]
    if query_len < call.mask.shape[2]:  # a decode group: repeat the query row (see the module docstring)
        query = query.expand(-1, call.mask.shape[2], -1, -1)
    query = query.transpose(1, 2).contiguous()  # SDPA's path also depends on the layout: always the same one
    shape = (call.num_seqs, -1, kv_heads, head_dim)
    keys, values = (
        rows.to(q.dtype).view(shape)[:, : call.num_keys].transpose(1, 2) for rows in cache.values_of(call.blocks)
    )
    if softcap is None:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=call.mask, scale=scale, enable_gqa=True)
    else:
        out = _softcapped_attention(query, keys, values, call.mask, scale, softcap)
    return out[:, :, :query_len].transpose(1, 2).reshape(-1, num_heads, head_dim)


def _softcapped_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with tanh soft-capped scores, in the order of operations Hugging Face's eager Gemma 2 uses (SDPA
    has no soft-capping): query [S, H, Q, D] over keys and values [S, KVH, K, D], mask [S, 1, Q, K].

    Its matmuls take SOFTCAP_QUERY_ROWS query rows per call (the last block zero-padded), so that a row's result does
    not depend on how many query rows share its call (a CPU GEMM's blocking does).
    """
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    rows = query.shape[2]
    padding = -rows % SOFTCAP_QUERY_ROWS
    if padding:  # padded rows see every key, so that their softmax stays finite; they are dropped
        query = torch.cat([query, query.new_zeros(*query.shape[:2], padding, query.shape[3])], dim=2)
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:2], padding, mask.shape[3])], dim=2)
    blocks = []
    for start in range(0, rows + padding, SOFTCAP_QUERY_ROWS):
        block = slice(start, start + SOFTCAP_QUERY_ROWS)
        scores = torch.matmul(query[:, :, block], keys.transpose(2, 3)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask[:, :, block], float("-inf"))
        blocks.append(torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), values))
    return torch.cat(blocks, dim=2)[:, :, :rows]
