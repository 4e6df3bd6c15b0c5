"""The C++ paged attention kernel agrees with float64 attention in every KV format and is bitwise batch-invariant;
its store of a step's K/V is the reference (torch) store bit for bit."""

from __future__ import annotations

import pytest
import torch

from statelm.attention.base import AttentionMetadata
from statelm.attention.cpu_kernel import CpuKernelAttentionBackend
from statelm.attention.kv_format import Q8_GROUP, quantize_q8_0
from statelm.engine.kv_cache import KVCache
from statelm.kernels.build import KernelBuildError, load_kernels
from tests.unit.kernel_threads import kernel_threads
from tests.unit.paged_cases import KV_FORMATS, dense_attention, fill_with_noise, paged_case, stored, stored_rows

try:
    load_kernels()
except KernelBuildError as exc:
    pytest.skip(f"statelm C++ kernels cannot be built here: {exc}", allow_module_level=True)

SCALE = 0.25


def run_case(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    window: int | None = None,
    softcap: float | None = None,
    **case: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel backend output, dense float64 output over the K/V as stored) for one flat batch.

    The step's new K/V are stored by the kernel (kv_store): they must read back as the format stores them.
    """
    batch = paged_case(query_lens, seq_lens, **case)  # type: ignore[arg-type]
    out = CpuKernelAttentionBackend(window, softcap).forward(
        batch.queries, batch.new_k, batch.new_v, batch.layer, batch.meta, SCALE
    )
    assert out.dtype == batch.queries.dtype and out.shape == batch.queries.shape
    kv = str(case.get("kv", "float32"))
    keys, values = stored_rows(batch.cache, batch.meta.slot_mapping)
    assert torch.equal(keys, stored(batch.new_k, kv)) and torch.equal(values, stored(batch.new_v, kv))
    return out, batch.expected(SCALE, window, softcap)


CASES = {
    "single-prefill": ([17], [17]),
    "prefill-with-cached-prefix": ([7], [23]),
    "single-decode": ([1], [11]),
    "decodes-of-different-lengths": ([1, 1, 1], [5, 13, 1]),
    "mixed": ([12, 1, 6, 1], [12, 9, 21, 30]),
    "block-boundaries": ([5, 1, 4], [10, 6, 15]),
    "many-chunks": ([45, 1, 70, 3], [110, 300, 70, 64]),
    "many-partitions": ([1, 40, 1], [1300, 1060, 513]),  # keys fold 512 at a time; decodes split over threads
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


@pytest.mark.parametrize("case", ["mixed", "many-chunks", "many-partitions"])
@pytest.mark.parametrize(("kv", "window"), [("float32", None), ("q8_0", None), ("float16", 40)])
@pytest.mark.parametrize("softcap", [0.4, 1.5, 50.0])
def test_soft_capped_scores_match_dense_attention(case: str, kv: str, window: int | None, softcap: float) -> None:
    """Gemma 2's cap * tanh(score / cap): scores of standard deviation ~1 land on both sides of the kernel's tanh
    switch (|score / cap| = 0.55) and deep in its flat ends."""
    out, expected = run_case(*CASES[case], head_dim=64, kv=kv, window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    uncapped, _ = run_case(*CASES[case], head_dim=64, kv=kv, window=window)
    assert not torch.allclose(out, uncapped, atol=1e-3)  # the cap changed the result


def test_rejects_a_negative_softcap() -> None:
    batch = paged_case([1], [3])
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        CpuKernelAttentionBackend(None, -1.0).forward(
            batch.queries, batch.new_k, batch.new_v, batch.layer, batch.meta, SCALE
        )


@pytest.mark.parametrize("head_dim", [8, 24, 64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 5, 8, 32])
def test_head_dims_and_block_sizes(head_dim: int, block_size: int) -> None:
    """Block sizes that hold whole key vectors are read in place, the others gathered: the same values."""
    out, expected = run_case(*CASES["many-chunks"], heads=9, kv_heads=3, head_dim=head_dim, block_size=block_size)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize(("head_dim", "block_size"), [(32, 16), (64, 16), (64, 5), (128, 32)])
def test_every_kv_format_matches_dense_attention_over_what_it_stores(kv: str, head_dim: int, block_size: int) -> None:
    out, expected = run_case(
        *CASES["many-chunks"], heads=9, kv_heads=3, head_dim=head_dim, block_size=block_size, kv=kv
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("window", [4, 40])
def test_every_kv_format_with_a_sliding_window(kv: str, window: int) -> None:
    out, expected = run_case(*CASES["mixed"], head_dim=32, kv=kv, window=window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv", ["bfloat16", "float16", "q8_0"])
def test_half_precision_queries_give_output_in_their_dtype(dtype: torch.dtype, kv: str) -> None:
    out, expected = run_case(*CASES["mixed"], head_dim=32, kv=kv, dtype=dtype)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def q8_0_edge_rows() -> torch.Tensor:
    """K rows [tokens, 2, 64] whose groups hit q8_0's edges: ties, a zero group, subnormal and huge scales."""
    rows = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(5))
    step = 2.0**-6  # a float16 scale that max|x| = 127 * step gives exactly
    ties = torch.tensor([127.0, -127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5] * 4) * step
    rows[0, 0, :Q8_GROUP] = ties
    rows[0, 1, Q8_GROUP:] = 0.0
    rows[1, 0] *= 1e-4  # subnormal float16 scales: values that round past 127 are clamped
    rows[1, 1] *= 1e4  # scales near its top
    rows[2, 0, :Q8_GROUP] = 1e-30  # a scale that rounds to 0: every value stored as 0
    return rows


@pytest.mark.invariance
@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("block_size", [16, 5])
def test_kernel_store_equals_the_reference_store(kv: str, block_size: int) -> None:
    gen = torch.Generator().manual_seed(2)
    k = torch.cat([q8_0_edge_rows(), torch.randn(20, 2, 64, generator=gen)])
    v = torch.cat([torch.randn(20, 2, 64, generator=gen), q8_0_edge_rows() * 3])
    slots = torch.randperm(8 * block_size, generator=gen)[: len(k)]
    kernel, reference = (KVCache(1, 8, block_size, 2, 64, kv, "cpu") for _ in range(2))
    fill_with_noise(kernel, gen)
    for layer, other in zip(reference.layers, kernel.layers, strict=True):
        for (plane, _), (noise, _) in zip(layer.planes(), other.planes(), strict=True):
            plane.copy_(noise)
    layer = kernel.layers[0]
    torch.ops.statelm.kv_store(k, v, layer.k, layer.v, layer.k_scale, layer.v_scale, slots)
    reference.layers[0].store(k, v, slots)
    for (ours, _), (theirs, _) in zip(layer.planes(), reference.layers[0].planes(), strict=True):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.invariance
def test_q8_0_quantization_rounds_ties_to_even_and_zero_scales_to_zero() -> None:
    values, scales = quantize_q8_0(q8_0_edge_rows())
    assert scales[0, 0, 0].item() == 2.0**-6
    assert values[0, 0, :8].tolist() == [127, -127, 2, 4, -2, 0, 0, 2]
    assert not values[0, 1, Q8_GROUP:].any() and scales[0, 1, 1] == 0
    assert scales[2, 0, 0] == 0 and not values[2, 0, :Q8_GROUP].any()
    assert values.abs().max() <= 127


def test_strided_step_rows_are_stored_as_contiguous_ones() -> None:
    qkv = torch.randn(5, 3 * 2 * 32)
    k, v = qkv[:, 64:128].view(5, 2, 32), qkv[:, 128:].view(5, 2, 32)  # views into the fused QKV projection
    strided, dense = (KVCache(1, 2, 4, 2, 32, "q8_0", "cpu").layers[0] for _ in range(2))
    slots = torch.tensor([0, 1, 2, 5, 6])
    torch.ops.statelm.kv_store(k, v, strided.k, strided.v, strided.k_scale, strided.v_scale, slots)
    torch.ops.statelm.kv_store(k.contiguous(), v.contiguous(), dense.k, dense.v, dense.k_scale, dense.v_scale, slots)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(strided.planes(), dense.planes(), strict=True))


def test_int32_block_tables() -> None:
    out, expected = run_case(*CASES["mixed"], index_dtype=torch.int32)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_strided_queries_are_read_in_place() -> None:
    qkv = torch.randn(5, 3 * 4 * 16)
    q = qkv[:, : 4 * 16].view(5, 4, 16)  # what the model passes: a view into the fused QKV projection
    k_cache, v_cache = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 8, 16)
    args = (k_cache, v_cache, torch.tensor([[1]]), torch.tensor([8]), torch.tensor([0, 5]), 0.5, 0)
    strided = torch.ops.statelm.paged_attention(q, *args)
    assert torch.equal(strided, torch.ops.statelm.paged_attention(q.contiguous(), *args))


def test_plan_is_rebuilt_for_a_new_step() -> None:
    backend = CpuKernelAttentionBackend()
    q = torch.randn(2, 2, 8)
    kv = torch.randn(2, 2, 8)
    first = AttentionMetadata(torch.tensor([0, 1]), torch.tensor([[0]]), [2], [2], [0, 2])
    second = AttentionMetadata(torch.tensor([4, 8]), torch.tensor([[1], [2]]), [1, 1], [1, 1], [0, 1, 2])
    backend.forward(q, kv, kv, KVCache(1, 4, 4, 2, 8, "float32", "cpu").layers[0], first, 1.0)
    out = backend.forward(q, kv, kv, KVCache(1, 4, 4, 2, 8, "float32", "cpu").layers[0], second, 1.0)
    torch.testing.assert_close(out, kv)  # each sequence of one token sees only its own value


def test_rejects_block_ids_outside_the_cache() -> None:
    q, layer = torch.randn(1, 2, 8), KVCache(1, 2, 4, 2, 8, "float32", "cpu").layers[0]
    lengths, starts = torch.tensor([3]), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.statelm.paged_attention(q, layer.k, layer.v, torch.tensor([[5]]), lengths, starts, 1.0, 0)


def test_rejects_caches_of_the_old_layout_and_int8_without_scales() -> None:
    q = torch.randn(1, 2, 8)
    tables, lengths, starts = torch.tensor([[0]]), torch.tensor([1]), torch.tensor([0, 1])
    cache = torch.zeros(2, 4, 2, 8)  # [blocks, block_size, KVH, D]: keys not transposed
    with pytest.raises(RuntimeError, match="v_cache must be"):
        torch.ops.statelm.paged_attention(q, cache, cache, tables, lengths, starts, 1.0, 0)
    q8 = KVCache(1, 2, 4, 2, 32, "q8_0", "cpu").layers[0]
    with pytest.raises(RuntimeError, match="need k_scale"):
        torch.ops.statelm.paged_attention(torch.randn(1, 2, 32), q8.k, q8.v, tables, lengths, starts, 1.0, 0)


LONG = [("float16", 2100, None, None), ("q8_0", 2100, 600, None)]  # several key partitions, split decodes
SOFT_CAPPED = [("float32", 150, 37, 1.0)]  # the cap bends scores before the softmax: no other path to cover


@pytest.mark.invariance
@pytest.mark.parametrize(
    ("kv", "length", "window", "softcap"),
    [(kv, 150, window, None) for kv in KV_FORMATS for window in (None, 37)] + LONG + SOFT_CAPPED,
)
def test_a_row_is_bitwise_the_same_whatever_shares_its_call(
    kv: str, length: int, window: int | None, softcap: float | None
) -> None:
    """Also over several key partitions (2,100 keys), whose states a lone decode splits over threads, and with
    soft-capped scores."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(length, kv_heads, head_dim, generator=gen)
    values = torch.randn(length, kv_heads, head_dim, generator=gen)
    queries = torch.randn(length, heads, head_dim, generator=gen)
    other_q = torch.randn(40, heads, head_dim, generator=gen)
    blocks = -(-length // block_size)
    cache = KVCache(1, 2 * blocks + 1, block_size, kv_heads, head_dim, kv, "cpu")
    fill_with_noise(cache, gen)  # the other sequence's blocks: noise
    layer = cache.layers[0]
    layer.store(keys, values, torch.arange(length) + block_size)  # blocks 1 .. blocks
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
            layer.k,
            layer.v,
            tables[[seq for seq, _, _ in spans]],
            torch.tensor([last for _, _, last in spans]),
            torch.tensor(starts),
            0.125,
            window or 0,
            layer.k_scale,
            layer.v_scale,
            softcap or 0.0,
        )

    with kernel_threads(1):
        prefill = attend(0, length)
    with kernel_threads(2):
        assert torch.equal(attend(0, length), prefill)
        edges = {0, 31, 32, 511, 512, 1023, 1024, 1535, 1536, 2047, 2048, length - 1}
        rows = range(length) if length < 512 else sorted({*range(0, length, 61), *(e for e in edges if e < length)})
        mismatched = [row for row in rows if not torch.equal(attend(row, row + 1)[0], prefill[row])]
        assert mismatched == []
        firsts = (16, 32, 117, 133, length - 1) if length < 512 else (1536, 2047, length - 1)
        for first in firsts:  # a prompt whose first rows came from the prefix cache
            assert torch.equal(attend(first, length), prefill[first:])
    for row in (0, 31, 32, 100, length - 1):  # beside another sequence's prefill, and beside its decodes
        assert torch.equal(attend(row, row + 1, other=(0, 40))[0], prefill[row])
        assert torch.equal(attend(row, row + 1, other=(39, 40))[0], prefill[row])
    reference = dense_attention(queries, stored(keys, kv), stored(values, kv), 0.125, window, softcap)
    torch.testing.assert_close(prefill.double(), reference, atol=1e-5, rtol=1e-5)
