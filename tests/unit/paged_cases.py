"""Flat batches over a shuffled paged KV cache, in any KV format, with their float64 attention for reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from statelm.attention.base import AttentionMetadata
from statelm.attention.kv_format import decode_rows, encode_rows, kv_format
from statelm.engine.kv_cache import KVCache, LayerKV

KV_FORMATS = ["float32", "float16", "bfloat16", "q8_0"]


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None, softcap: float | None = None
) -> torch.Tensor:
    """Float64 causal attention of the last len(q) positions of a context k/v [ctx, kv_heads, dim] (scores
    soft-capped: softcap * tanh(scores / softcap))."""
    query_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = torch.arange(ctx - query_len, ctx).view(-1, 1)
    key_pos = torch.arange(ctx).view(1, -1)
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def stored(x: torch.Tensor, kv: str) -> torch.Tensor:
    """K or V [tokens, heads, dim] as a cache of format kv holds them (float32)."""
    return decode_rows(encode_rows(x, kv_format(kv)))


def fill_with_noise(cache: KVCache, generator: torch.Generator) -> None:
    """Random contents in every block (int8 values and float16 scales for q8_0): slots no row may read."""
    for layer in cache.layers:
        for plane, _ in layer.planes():
            if plane.dtype == torch.int8:
                plane.copy_(torch.randint(-127, 128, plane.shape, generator=generator, dtype=torch.int8))
            else:
                plane.copy_(torch.randn(plane.shape, generator=generator).to(plane.dtype))


@dataclass
class PagedCase:
    """One step's inputs: queries and new K/V of every sequence, the cache holding their cached prefixes."""

    queries: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    cache: KVCache
    meta: AttentionMetadata
    contexts: list[tuple[torch.Tensor, torch.Tensor]]  # per sequence, its whole K/V as the cache stores them

    @property
    def layer(self) -> LayerKV:
        """The cache's only layer."""
        return self.cache.layers[0]

    def expected(self, scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Float64 attention of every query row over its sequence's stored K/V."""
        out, start = [], 0
        for (k, v), query_len in zip(self.contexts, self.meta.query_lens, strict=True):
            out.append(dense_attention(self.queries[start : start + query_len], k, v, scale, window, softcap))
            start += query_len
        return torch.cat(out)


def paged_case(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    heads: int = 6,
    kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 5,
    kv: str = "float32",
    dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int64,
    seed: int = 0,
) -> PagedCase:
    """A step of sequences whose first seq_len - query_len tokens are cached, in shuffled blocks among noise."""
    gen = torch.Generator().manual_seed(seed + sum(seq_lens) * 7 + len(query_lens) + head_dim)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(n)] for n in blocks_per_seq]
    cache = KVCache(1, num_blocks, block_size, kv_heads, head_dim, kv, "cpu")
    fill_with_noise(cache, gen)
    queries = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
    slots, new_k, new_v, contexts = [], [], [], []
    for table, query_len, seq_len in zip(tables, query_lens, seq_lens, strict=True):
        k = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        cached = seq_len - query_len
        cache.layers[0].store(k[:cached], v[:cached], torch.tensor(seq_slots[:cached], dtype=torch.int64))
        slots += seq_slots[cached:]
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        contexts.append((stored(k, kv), stored(v, kv)))
    width = max(blocks_per_seq) + 1  # one spare column: tables are padded
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=index_dtype),
        query_lens=query_lens,
        seq_lens=seq_lens,
        query_start=[sum(query_lens[:i]) for i in range(len(query_lens) + 1)],
    )
    return PagedCase(queries, torch.cat(new_k), torch.cat(new_v), cache, meta, contexts)


def stored_rows(cache: KVCache, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the tokens in slots, as float32 [tokens, heads, dim], read back from the cache's only layer."""
    size = cache.block_size
    blocks = sorted({int(slot) // size for slot in slots})
    keys, values = cache.layers[0].values_of(torch.tensor(blocks))
    row = {block: i for i, block in enumerate(blocks)}
    index = torch.tensor([row[int(slot) // size] * size + int(slot) % size for slot in slots])
    return keys.float()[index], values.float()[index]
