"""Copies of a session's K/V between the paged pool and host memory: exact on the CPU, asynchronous on CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from statelm.attention.kv_format import pack_q8_0
from statelm.engine.block_pool import BlockPool
from statelm.engine.kv_cache import KVCache
from statelm.engine.kv_manager import BlockTable, KVManager
from statelm.engine.session_kv import SessionBlocks, SessionKVData, SessionKVStore
from tests.unit.paged_cases import KV_FORMATS, fill_with_noise

BLOCK = 4
HEADS, DIM = 2, 32

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def filled_cache(
    device: str, kv: str, num_blocks: int = 16, num_layers: int = 3, heads: int = HEADS, dim: int = DIM
) -> KVCache:
    """A cache whose every block holds distinct random values."""
    cache = KVCache(num_layers, num_blocks, BLOCK, heads, dim, kv, "cpu")
    fill_with_noise(cache, torch.Generator().manual_seed(0))
    if device == "cpu":
        return cache
    on_device = KVCache(num_layers, num_blocks, BLOCK, heads, dim, kv, device)
    for source, target in zip(cache.layers, on_device.layers, strict=True):
        for (plane, _), (copy, _) in zip(source.planes(), target.planes(), strict=True):
            copy.copy_(plane)
    return on_device


def large_cache(device: str, kv: str, num_blocks: int) -> KVCache:
    """Four layers; on CUDA wide enough (256 MiB per tensor at 4096 blocks) that a copy to the host takes a while."""
    return filled_cache(device, kv, num_blocks, 4, *((8, 1024) if device == "cuda" else (HEADS, DIM)))


def expected_rows(cache: KVCache, blocks: list[int], num_tokens: int) -> list[torch.Tensor]:
    """Every layer's K rows, then every layer's V rows, of the first num_tokens tokens of blocks (kv_format's row
    form), read directly (synchronously) from the block layout: keys [blocks, H, D, S], values [blocks, H, S, D]."""

    def rows(plane: torch.Tensor, transposed: bool) -> torch.Tensor:
        picked = plane[blocks].cpu()
        return (picked.permute(0, 3, 1, 2) if transposed else picked.transpose(1, 2)).flatten(0, 1)[:num_tokens]

    keys, values = [], []
    for layer in cache.layers:
        k, v = rows(layer.k, True), rows(layer.v, False)
        if layer.k_scale is not None and layer.v_scale is not None:
            k, v = pack_q8_0(k, rows(layer.k_scale, True)), pack_q8_0(v, rows(layer.v_scale, False))
        keys.append(k)
        values.append(v)
    return keys + values


def shuffled_blocks(count: int, num_blocks: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(num_blocks), count)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 4, 7, 13])
def test_gather_then_scatter_round_trip_is_bit_exact(device: str, kv: str, num_tokens: int) -> None:
    source = filled_cache(device, kv)
    blocks = shuffled_blocks(-(-num_tokens // BLOCK), 16, seed=num_tokens)
    expected = expected_rows(source, blocks, num_tokens)
    keys, values, ready = source.gather(blocks, num_tokens)
    data = SessionKVData(list(range(num_tokens)), keys, values, ready)
    for ours, theirs in zip(data.keys + data.values, expected, strict=True):
        assert ours.device.type == "cpu" and ours.dtype == source.format.row_dtype and ours.is_contiguous()
        assert torch.equal(ours, theirs)
    target = KVCache(3, 16, BLOCK, HEADS, DIM, kv, device)
    into = shuffled_blocks(len(blocks), 16, seed=100 + num_tokens)
    target.scatter(into, *data.in_flight())
    assert all(torch.equal(a, b) for a, b in zip(expected_rows(target, into, num_tokens), expected, strict=True))
    for rows in expected_rows(target, into, len(into) * BLOCK):
        assert not rows[num_tokens:].any()  # the unused rows of the last block are zeroed


def test_scatter_refuses_rows_of_another_format() -> None:
    keys, values, _ = filled_cache("cpu", "float32").gather([0], 3)
    with pytest.raises(ValueError, match="do not fit a q8_0 pool"):
        KVCache(3, 16, BLOCK, HEADS, DIM, "q8_0", "cpu").scatter([0], keys, values)


def test_cpu_gather_is_complete_when_it_returns() -> None:
    cache = filled_cache("cpu", "float32")
    keys, _, ready = cache.gather([3, 1], 6)
    assert ready is None
    assert torch.equal(keys[0], expected_rows(cache, [3, 1], 6)[0])
    cache.k[0].fill_(0.0)  # a later write into the pool does not reach the copy
    assert keys[0].any()


@pytest.mark.parametrize("device", DEVICES)
def test_gather_of_an_empty_session_gives_empty_tensors(device: str) -> None:
    cache = filled_cache(device, "bfloat16")
    keys, values, ready = cache.gather([], 0)
    assert ready is None
    assert len(keys) == len(values) == 3
    for tensor in keys + values:
        assert tensor.shape == (0, HEADS, DIM) and tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu"
    keys, _, _ = filled_cache(device, "q8_0").gather([], 0)
    assert keys[0].shape == (0, HEADS, DIM // 32 * 34) and keys[0].dtype == torch.uint8


def test_session_kv_data_wait_is_a_no_op_on_cpu_data() -> None:
    keys, values = [torch.ones(2, HEADS, DIM)], [torch.zeros(2, HEADS, DIM)]
    data = SessionKVData([1, 2], keys, values)
    data.wait()
    data.wait()
    assert data.ready is None
    assert data.keys is keys and data.values is values
    assert data.in_flight() == (keys, values, None)


def test_fence_reads_without_gathers_in_flight_does_nothing() -> None:
    cache = filled_cache("cpu", "float32")
    cache.gather([0, 1], 8)
    cache.fence_reads([0, 1])


def store_holding(cache: KVCache, num_tokens: int, seed: int) -> tuple[SessionKVStore, list[int]]:
    """A store whose session "s" holds num_tokens tokens in shuffled blocks of cache (as filled, no scatter)."""
    pool = BlockPool(cache.num_blocks, BLOCK)
    store = SessionKVStore(KVManager(pool, cache))
    allocated = pool.allocate(pool.blocks_needed(num_tokens))
    blocks = random.Random(seed).sample(allocated, len(allocated))
    store.resident["s"] = SessionBlocks(list(range(num_tokens)), BlockTable(blocks), num_tokens)
    return store, blocks


@pytest.mark.parametrize("device", DEVICES)
def test_a_spill_keeps_the_old_kv_when_the_freed_blocks_are_overwritten_at_once(device: str) -> None:
    cache = large_cache(device, "bfloat16", 4096)
    num_tokens = 4096 * BLOCK - 3
    store, blocks = store_holding(cache, num_tokens, seed=1)
    expected = expected_rows(cache, blocks, num_tokens)
    spilled: list[SessionKVData] = []
    store.spill_handler = lambda session_id, data: spilled.append(data)
    assert store.reclaim(4096)
    assert store.kv.num_free_blocks == 4096 and "s" not in store.resident
    for tensor in (*cache.k, *cache.v):
        tensor.fill_(-1.0)  # the next forward writing into the freed blocks, queued at once on the compute stream
    (data,) = spilled
    for ours, theirs in zip(data.keys + data.values, expected, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("device", DEVICES)
def test_an_export_keeps_its_kv_when_the_session_is_released_and_its_blocks_reused(device: str) -> None:
    cache = large_cache(device, "float16", 2048)
    store, blocks = store_holding(cache, 2048 * BLOCK, seed=2)
    expected = expected_rows(cache, blocks, 2048 * BLOCK)
    data = store.export("s")
    store.release("s")  # e.g. a session deleted right after its snapshot was taken
    assert sorted(store.kv.pool.allocate(2048)) == list(range(2048))
    for tensor in (*cache.k, *cache.v):
        tensor.add_(1.0)  # written by the compute stream while the export may still be copying
    assert data is not None
    for ours, theirs in zip(data.keys + data.values, expected, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("device", DEVICES)
def test_a_restore_is_visible_to_the_next_forward_and_may_come_straight_from_an_export(device: str) -> None:
    source = large_cache(device, "q8_0", 1024)
    num_tokens = 1024 * BLOCK - 1
    source_store, blocks = store_holding(source, num_tokens, seed=3)
    expected = expected_rows(source, blocks, num_tokens)
    data = source_store.export("s")  # on CUDA possibly still copying: load must wait for it on the GPU
    assert data is not None
    target_cache = KVCache(4, 1024, BLOCK, source.num_kv_heads, source.head_dim, "q8_0", device)
    target = SessionKVStore(KVManager(BlockPool(1024, BLOCK), target_cache))
    target.load("s", data)
    restored = target.resident["s"].table.blocks
    got = expected_rows(target_cache, restored, num_tokens)  # read on the compute stream
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gather_returns_pinned_tensors_and_an_event_that_completes_them() -> None:
    cache = filled_cache("cuda", "bfloat16", num_blocks=256)
    blocks = shuffled_blocks(200, 256, seed=4)
    keys, values, ready = cache.gather(blocks, 200 * BLOCK - 2)
    assert isinstance(ready, torch.cuda.Event)
    assert all(tensor.is_pinned() for tensor in keys + values)
    data = SessionKVData(list(range(200 * BLOCK - 2)), keys, values, ready)
    data.wait()
    assert data.ready is None and ready.query()
    expected = expected_rows(cache, blocks, 200 * BLOCK - 2)
    assert all(torch.equal(a, b) for a, b in zip(data.keys + data.values, expected, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_export_does_not_hold_up_the_compute_stream() -> None:
    # one layer of 2 GiB per K and V: the copy to the host takes tens of milliseconds, a tiny kernel microseconds
    cache = KVCache(1, 65536, 16, 8, 128, torch.bfloat16, "cuda")
    for tensor in (*cache.k, *cache.v):
        tensor.normal_()
    small = torch.ones(16, device="cuda")
    small.mul_(1.0)  # loaded before the copy: CUDA's lazy loading of a kernel's module waits for the whole device
    torch.cuda.synchronize()
    keys, values, ready = cache.gather(list(range(65536)), 65536 * 16)
    small.mul_(2.0)
    small_done = torch.cuda.Event()
    small_done.record()
    small_done.synchronize()
    assert ready is not None and not ready.query()  # the compute stream ran past the copy still in flight
    SessionKVData([], keys, values, ready).wait()
    assert torch.equal(values[0][:16], cache.v[0][0].transpose(0, 1).cpu())
