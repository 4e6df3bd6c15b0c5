"""The torch reference attention backend agrees with naive dense attention on mixed paged batches."""

from __future__ import annotations

import pytest
import torch

from statelm.attention.base import AttentionMetadata
from statelm.attention.reference import TorchAttentionBackend
from statelm.cpu import cpu_flags, describe, native_bf16
from statelm.engine.kv_cache import KVCache
from tests.unit.paged_cases import KV_FORMATS, paged_case, stored, stored_rows


def run_case(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    window: int | None = None,
    per_row: bool = False,
    **case: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(backend output, float64 output over the K/V as stored) for one flat batch; the step's K/V are stored too."""
    batch = paged_case(query_lens, seq_lens, **case)  # type: ignore[arg-type]
    backend = TorchAttentionBackend(window, per_row)
    out = backend.forward(batch.queries, batch.new_k, batch.new_v, batch.layer, batch.meta, 0.25)
    kv = str(case.get("kv", "float32"))
    keys, values = stored_rows(batch.cache, batch.meta.slot_mapping)
    assert torch.equal(keys, stored(batch.new_k, kv)) and torch.equal(values, stored(batch.new_v, kv))
    return out, batch.expected(0.25, window)


CASES = {
    "single-prefill": ([17], [17]),
    "prefill-with-cached-prefix": ([7], [23]),
    "single-decode": ([1], [11]),
    "decodes-of-different-lengths": ([1, 1, 1], [5, 13, 1]),
    "mixed": ([12, 1, 6, 1], [12, 9, 21, 30]),
    "block-boundaries": ([5, 1, 4], [10, 6, 15]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("per_row", [False, True], ids=["sdpa-rows", "per-row"])
def test_matches_naive_attention(case: str, heads: int, kv_heads: int, per_row: bool) -> None:
    out, expected = run_case(*CASES[case], heads=heads, kv_heads=kv_heads, per_row=per_row)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("per_row", [False, True], ids=["sdpa-rows", "per-row"])
def test_sliding_window_matches_naive_attention(case: str, per_row: bool) -> None:
    out, expected = run_case(*CASES[case], window=4, per_row=per_row)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_is_close_to_exact() -> None:
    out, expected = run_case(*CASES["mixed"], dtype=torch.bfloat16, kv="bfloat16")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("per_row", [False, True], ids=["sdpa-rows", "per-row"])
def test_every_kv_format_matches_naive_attention_over_what_it_stores(kv: str, per_row: bool) -> None:
    out, expected = run_case(*CASES["mixed"], head_dim=32, kv=kv, per_row=per_row)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_plan_is_rebuilt_for_a_new_step() -> None:
    backend = TorchAttentionBackend()
    q = torch.randn(2, 2, 8)
    kv = torch.randn(2, 2, 8)
    first = AttentionMetadata(torch.tensor([0, 1]), torch.tensor([[0]]), [2], [2], [0, 2])
    second = AttentionMetadata(torch.tensor([4, 8]), torch.tensor([[1], [2]]), [1, 1], [1, 1], [0, 1, 2])
    backend.forward(q, kv, kv, KVCache(1, 4, 4, 2, 8, "float32", "cpu").layers[0], first, 1.0)
    out = backend.forward(q, kv, kv, KVCache(1, 4, 4, 2, 8, "float32", "cpu").layers[0], second, 1.0)
    torch.testing.assert_close(out, kv)


@pytest.mark.invariance
@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("per_row", [True, False], ids=["per-row", "sdpa-rows"])
def test_a_row_gives_the_same_result_whatever_the_number_of_query_rows_in_its_call(per_row: bool, kv: str) -> None:
    """Per-row mode holds on every CPU; several rows per SDPA call hold where torch's bf16 SDPA runs on AMX.

    Elsewhere (AVX2, and AVX512-BF16 without AMX, as on AMD Zen 4/5: row 119 of 150 differs) torch's kernel
    blocks by row count, and the start-up self-check (tests/models/test_invariance.py) rejects the SDPA-rows path.
    """
    if not per_row and not (native_bf16() and "amx_bf16" in cpu_flags()):
        pytest.skip(f"torch's bf16 SDPA blocks by row count on {describe()}; the self-check rejects it there")
    heads, kv_heads, head_dim, block_size, length = 9, 3, 64, 16, 150
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(length, kv_heads, head_dim, generator=gen).bfloat16()
    values = torch.randn(length, kv_heads, head_dim, generator=gen).bfloat16()
    queries = torch.randn(length, heads, head_dim, generator=gen).bfloat16()
    num_blocks = -(-length // block_size)
    table = torch.arange(num_blocks).view(1, -1)

    def attend(first: int, last: int) -> torch.Tensor:
        """Rows first..last-1 as one query chunk over keys 0..last-1."""
        cache = KVCache(1, num_blocks, block_size, kv_heads, head_dim, kv, "cpu").layers[0]
        cache.store(keys[:first], values[:first], torch.arange(first))
        meta = AttentionMetadata(torch.arange(first, last), table, [last - first], [last], [0, last - first])
        backend = TorchAttentionBackend(per_row=per_row)
        return backend.forward(queries[first:last], keys[first:last], values[first:last], cache, meta, 0.125)

    prefill = attend(0, length)
    mismatched = [row for row in range(100, length) if not torch.equal(attend(row, row + 1)[0], prefill[row])]
    assert mismatched == []
    for first in (16, 32, 117, 133):  # a prompt whose first rows came from the prefix cache
        assert torch.equal(attend(first, length), prefill[first:])


def test_soft_capped_attention_matches_dense_soft_capped_attention() -> None:
    heads, kv_heads, head_dim, length, cap = 4, 2, 16, 37, 0.8
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(length, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    cache = KVCache(1, 4, 16, kv_heads, head_dim, "float32", "cpu").layers[0]
    meta = AttentionMetadata(torch.arange(length), torch.tensor([[0, 1, 2]]), [length], [length], [0, length])
    out = TorchAttentionBackend(sliding_window=9, softcap=cap).forward(q, k, v, cache, meta, 0.3)
    keys, values = (x.double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1) for x in (k, v))
    scores = torch.tanh(q.double().transpose(0, 1) @ keys.transpose(1, 2) * 0.3 / cap) * cap
    position = torch.arange(length)
    visible = (position[None, :] <= position[:, None]) & (position[None, :] > position[:, None] - 9)
    expected = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values).transpose(0, 1)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.invariance
def test_soft_capped_attention_passes_the_self_checks_attention_probe() -> None:
    from statelm.models.invariance import probe_attention

    for dtype in (torch.float32, torch.bfloat16):
        backend = TorchAttentionBackend(softcap=1.5)
        assert probe_attention(backend, 8, 4, 64, dtype, torch.device("cpu")) == []
