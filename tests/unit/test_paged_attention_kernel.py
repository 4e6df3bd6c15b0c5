"""The C++ paged attention kernel agrees with naive float64 attention and is bitwise batch-invariant."""

from __future__ import annotations

import pytest
import torch

from statelm.attention.base import AttentionMetadata
from statelm.attention.cpu_kernel import CpuKernelAttentionBackend
from statelm.kernels.build import KernelBuildError, load_kernels
from tests.unit.kernel_threads import kernel_threads

try:
    load_kernels()
except KernelBuildError as exc:
    pytest.skip(f"statelm C++ kernels cannot be built here: {exc}", allow_module_level=True)

SCALE = 0.25


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """Float64 causal attention of the last len(q) positions of a context k/v [ctx, kv_heads, dim]."""
    query_len, heads, _ = q.shape
    ctx, kv_heads, _ = k.shape
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(ctx - query_len, ctx).view(-1, 1)
    key_pos = torch.arange(ctx).view(1, -1)
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def run_case(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    heads: int = 6,
    kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 5,
    window: int | None = None,
    cache_dtype: torch.dtype = torch.float32,
    dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel backend output, dense float64 output) for one flat batch over a shuffled paged cache."""
    gen = torch.Generator().manual_seed(sum(seq_lens) * 7 + len(query_lens) + head_dim)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(n)] for n in blocks_per_seq]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)  # unused slots hold noise, never read
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    queries = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
    slots, new_k, new_v, expected = [], [], [], []
    start = 0
    for table, query_len, seq_len in zip(tables, query_lens, seq_lens, strict=True):
        k = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(cache_dtype)
        v = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(cache_dtype)
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        cached = seq_len - query_len
        k_cache.view(-1, kv_heads, head_dim)[seq_slots[:cached]] = k[:cached]
        v_cache.view(-1, kv_heads, head_dim)[seq_slots[:cached]] = v[:cached]
        slots += seq_slots[cached:]
        new_k.append(k[cached:].to(dtype))
        new_v.append(v[cached:].to(dtype))
        expected.append(dense_attention(queries[start : start + query_len], k, v, SCALE, window))
        start += query_len
    width = max(blocks_per_seq) + 1  # one spare column: tables are padded
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=index_dtype),
        query_lens=query_lens,
        seq_lens=seq_lens,
        query_start=[sum(query_lens[:i]) for i in range(len(query_lens) + 1)],
    )
    k_new, v_new = torch.cat(new_k), torch.cat(new_v)
    out = CpuKernelAttentionBackend(window).forward(queries, k_new, v_new, k_cache, v_cache, meta, SCALE)
    assert out.dtype == dtype and out.shape == queries.shape
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping], k_new.to(cache_dtype))
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[meta.slot_mapping], v_new.to(cache_dtype))
    return out, torch.cat(expected)


CASES = {
    "single-prefill": ([17], [17]),
    "prefill-with-cached-prefix": ([7], [23]),
    "single-decode": ([1], [11]),
    "decodes-of-different-lengths": ([1, 1, 1], [5, 13, 1]),
    "mixed": ([12, 1, 6, 1], [12, 9, 21, 30]),
    "block-boundaries": ([5, 1, 4], [10, 6, 15]),
    "many-chunks": ([45, 1, 70, 3], [110, 300, 70, 64]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (12, 3)])
def test_matches_dense_attention(case: str, heads: int, kv_heads: int) -> None:
    out, expected = run_case(*CASES[case], heads=heads, kv_heads=kv_heads)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [1, 4, 40])
def test_sliding_window_matches_dense_attention(case: str, window: int) -> None:
    out, expected = run_case(*CASES[case], window=window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 24, 64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 5])
def test_head_dims_and_block_sizes(head_dim: int, block_size: int) -> None:
    out, expected = run_case(*CASES["many-chunks"], heads=9, kv_heads=3, head_dim=head_dim, block_size=block_size)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_half_precision_caches_are_widened_exactly(cache_dtype: torch.dtype, head_dim: int) -> None:
    out, expected = run_case(*CASES["many-chunks"], head_dim=head_dim, cache_dtype=cache_dtype)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_queries_give_output_in_their_dtype(dtype: torch.dtype) -> None:
    out, expected = run_case(*CASES["mixed"], cache_dtype=dtype, dtype=dtype)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_int32_block_tables() -> None:
    out, expected = run_case(*CASES["mixed"], index_dtype=torch.int32)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_strided_queries_are_read_in_place() -> None:
    qkv = torch.randn(5, 3 * 4 * 16)
    q = qkv[:, : 4 * 16].view(5, 4, 16)  # what the model passes: a view into the fused QKV projection
    k_cache, v_cache = torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    args = (k_cache, v_cache, torch.tensor([[1]]), torch.tensor([8]), torch.tensor([0, 5]), 0.5, 0)
    strided = torch.ops.statelm.paged_attention(q, *args)
    assert torch.equal(strided, torch.ops.statelm.paged_attention(q.contiguous(), *args))


def test_plan_is_rebuilt_for_a_new_step() -> None:
    backend = CpuKernelAttentionBackend()
    q = torch.randn(2, 2, 8)
    kv = torch.randn(2, 2, 8)
    cache = torch.zeros(4, 4, 2, 8)
    first = AttentionMetadata(torch.tensor([0, 1]), torch.tensor([[0]]), [2], [2], [0, 2])
    second = AttentionMetadata(torch.tensor([4, 8]), torch.tensor([[1], [2]]), [1, 1], [1, 1], [0, 1, 2])
    backend.forward(q, kv, kv, cache, cache.clone(), first, 1.0)
    out = backend.forward(q, kv, kv, cache, cache.clone(), second, 1.0)
    torch.testing.assert_close(out, kv)  # each sequence of one token sees only its own value


def test_rejects_block_ids_outside_the_cache() -> None:
    q, cache = torch.randn(1, 2, 8), torch.zeros(2, 4, 2, 8)
    lengths, starts = torch.tensor([3]), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.statelm.paged_attention(q, cache, cache, torch.tensor([[5]]), lengths, starts, 1.0, 0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 37])
def test_a_row_is_bitwise_the_same_whatever_shares_its_call(cache_dtype: torch.dtype, window: int | None) -> None:
    heads, kv_heads, head_dim, block_size, length = 9, 3, 64, 16, 150
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(length, kv_heads, head_dim, generator=gen).to(cache_dtype)
    values = torch.randn(length, kv_heads, head_dim, generator=gen).to(cache_dtype)
    queries = torch.randn(length, heads, head_dim, generator=gen)
    other_q = torch.randn(40, heads, head_dim, generator=gen)
    blocks = -(-length // block_size)
    k_cache = torch.zeros(2 * blocks + 1, block_size, kv_heads, head_dim, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache[1 : blocks + 1].view(-1, kv_heads, head_dim)[:length] = keys
    v_cache[1 : blocks + 1].view(-1, kv_heads, head_dim)[:length] = values
    k_cache[blocks + 1 :] = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache[blocks + 1 :] = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    tables = torch.stack([torch.arange(1, blocks + 1), torch.arange(blocks + 1, 2 * blocks + 1)])

    def attend(first: int, last: int, other: tuple[int, int] | None = None) -> torch.Tensor:
        """Query rows [first, last) over keys [0, last), and the other sequence's rows `other` in the same call."""
        spans = [(0, first, last)] + ([(1, *other)] if other else [])
        q = torch.cat([(queries if seq == 0 else other_q)[first:last] for seq, first, last in spans])
        starts = [0]
        for _, first, last in spans:
            starts.append(starts[-1] + last - first)
        return torch.ops.statelm.paged_attention(
            q,
            k_cache,
            v_cache,
            tables[[seq for seq, _, _ in spans]],
            torch.tensor([last for _, _, last in spans]),
            torch.tensor(starts),
            0.125,
            window or 0,
        )

    with kernel_threads(1):
        prefill = attend(0, length)
    with kernel_threads(2):
        assert torch.equal(attend(0, length), prefill)
        mismatched = [row for row in range(length) if not torch.equal(attend(row, row + 1)[0], prefill[row])]
        assert mismatched == []
        for first in (16, 32, 117, 133, 149):  # a prompt whose first rows came from the prefix cache
            assert torch.equal(attend(first, length), prefill[first:])
    for row in (0, 31, 32, 100, 149):  # beside another sequence's prefill, and beside its decodes
        assert torch.equal(attend(row, row + 1, other=(0, 40))[0], prefill[row])
        assert torch.equal(attend(row, row + 1, other=(39, 40))[0], prefill[row])
