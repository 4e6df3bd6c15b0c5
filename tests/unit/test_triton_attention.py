"""The Triton attention backend agrees with float64 attention, stores KV by slot, and is bitwise batch-invariant.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) on
CPU tensors; with CUDA the same tests run compiled on the GPU (marked gpu). The interpreter's tl.dot is numpy's
matmul, whose result for a row depends on the row's place in the tile (OpenBLAS's kernels) and which reads
bfloat16 as raw integers; the GPU's tensor cores do neither, so under the interpreter the tests put in its place
a dot that computes every element alike (one float64 sum of its products, rounded once). Interpreted, the grids
keep one case of each path (GQA group, window, dtype and KV format, split or folded); compiled, every case runs.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from statelm.attention import triton_backend
from statelm.attention.base import AttentionMetadata
from statelm.attention.kv_format import kv_format
from statelm.attention.triton_backend import TritonAttentionBackend
from statelm.engine.kv_cache import KVCache
from tests.unit.paged_cases import fill_with_noise, stored

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA, not interpreted"),
        ],
    ),
]
# Cases that run compiled on the GPU only: under the interpreter (minutes of numpy) a sibling case covers their path
COMPILED_ONLY = pytest.mark.skipif(INTERPRETED, reason="interpreted: a sibling case covers this path; runs on CUDA")
SCALE = 0.3
PARTITION = 64  # small partitions, so that short test sequences cross several
Span = tuple[int, int, int]  # (sequence, first query position, context length after the step)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The device the kernels run on."""
    return request.param


@pytest.fixture(autouse=True)
def small_partitions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Partitions of PARTITION keys (one key tile of a 16-bit dot, four of a float32 one)."""
    monkeypatch.setattr(triton_backend, "PARTITION_SIZE", PARTITION)


def _as_float64(handle: object) -> np.ndarray:
    """An interpreter tensor's values as float64 (bfloat16 is held as its raw 16 bits)."""
    data = handle.data  # type: ignore[attr-defined]
    if data.dtype == np.uint16:
        return (data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return data.astype(np.float64)


def _row_independent_dot(
    self: object, a: object, b: object, acc: object, input_precision: object, max_num_imprecise_acc: object
) -> object:
    """tl.dot for the interpreter: each element one float64 sum of its products plus acc, rounded once."""
    from triton.runtime.interpreter import TensorHandle

    products = _as_float64(a)[:, :, None] * _as_float64(b)[None, :, :]
    out = products.sum(axis=1) + acc.data  # type: ignore[attr-defined]
    return TensorHandle(out.astype(acc.data.dtype), acc.dtype.scalar)  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def interpreter_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter, a tl.dot that computes every row alike (see the module docstring)."""
    if INTERPRETED:
        from triton.runtime.interpreter import InterpreterBuilder

        monkeypatch.setattr(InterpreterBuilder, "create_dot", _row_independent_dot)


@pytest.fixture(params=["split", "unsplit"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Force the key range split over programs (workspace + combine kernel) or folded inside each program."""
    monkeypatch.setattr(triton_backend, "SPLIT_MAX_PROGRAMS", 1 << 30 if request.param == "split" else 0)
    return request.param


class Sequences:
    """Sequences of fixed random queries, keys and values, each in shuffled blocks of one paged cache."""

    def __init__(
        self,
        lengths: list[int],
        *,
        heads: int = 2,
        kv_heads: int = 1,
        head_dim: int = 16,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        kv: str | None = None,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.dtype, self.kv, self.device = dtype, kv or kv_format(dtype).name, device
        self.block_size, self.kv_heads, self.head_dim = block_size, kv_heads, head_dim
        blocks = [-(-n // block_size) for n in lengths]
        self.num_blocks = sum(blocks) + 2
        order = torch.randperm(self.num_blocks, generator=gen).tolist()
        self.tables = [[order.pop() for _ in range(n)] for n in blocks]
        self.queries = [torch.randn(n, heads, head_dim, generator=gen).to(dtype) for n in lengths]
        # keys and values the cache holds exactly, so that storing them is exact (the interpreter rounds
        # float32 to bfloat16 by truncation; the GPU to nearest even, as torch does)
        self.keys = [stored(torch.randn(n, kv_heads, head_dim, generator=gen), self.kv) for n in lengths]
        self.values = [stored(torch.randn(n, kv_heads, head_dim, generator=gen), self.kv) for n in lengths]

    def slots(self, seq: int, first: int, last: int) -> list[int]:
        """Cache slots of positions [first, last) of a sequence."""
        size = self.block_size
        return [self.tables[seq][p // size] * size + p % size for p in range(first, last)]

    def run(
        self,
        spans: list[Span],
        window: int | None = None,
        *,
        padding_after: int | None = None,
        max_seq_len: int | None = None,
        index_dtype: torch.dtype = torch.int64,
        softcap: float | None = None,
    ) -> list[torch.Tensor]:
        """One step over the spans (query rows [first, last) of sequence seq over keys [0, last)); outputs per span.

        The cache starts as NaN (its scales, for q8_0) with each span's prefix [0, first) stored: values read from
        any other slot show.
        padding_after: a CUDA-graph padding sequence (one query row, context 0, slot -1) after that many spans.
        """
        cache = KVCache(1, self.num_blocks, self.block_size, self.kv_heads, self.head_dim, self.kv, "cpu")
        for plane, _ in cache.layers[0].planes():
            if plane.dtype != torch.int8:
                plane.fill_(float("nan"))
        layer = cache.layers[0]
        rows = []
        for seq, first, last in spans:
            slots = torch.tensor(self.slots(seq, 0, first), dtype=torch.int64)
            layer.store(self.keys[seq][:first], self.values[seq][:first], slots)
            rows.append((self.queries[seq][first:last], self.keys[seq][first:last], self.values[seq][first:last]))
        slots = [self.slots(seq, first, last) for seq, first, last in spans]
        tables = [self.tables[seq] for seq, _, _ in spans]
        query_lens = [last - first for _, first, last in spans]
        seq_lens = [last for _, _, last in spans]
        if padding_after is not None:
            heads, dim = self.queries[0].shape[1:]
            kv_heads = self.keys[0].shape[1]
            rows.insert(
                padding_after,
                (
                    torch.randn(1, heads, dim).to(self.dtype),
                    torch.randn(1, kv_heads, dim),
                    torch.randn(1, kv_heads, dim),
                ),
            )
            slots.insert(padding_after, [-1])
            tables.insert(padding_after, [10**9] * 4)  # never dereferenced: an out-of-bounds read would fault
            query_lens.insert(padding_after, 1)
            seq_lens.insert(padding_after, 0)
        width = max(len(t) for t in tables) + 1
        starts = [sum(query_lens[:i]) for i in range(len(query_lens) + 1)]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([slot for span in slots for slot in span], dtype=torch.int64, device=self.device),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=index_dtype, device=self.device
            ),
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start=starts,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            query_start_tensor=torch.tensor(starts, dtype=torch.int32, device=self.device),
            max_query_len=max(query_lens),
            max_seq_len=max_seq_len or max(seq_lens),
        )
        q, k, v = (torch.cat([row[i] for row in rows]).to(self.device) for i in range(3))
        on_device = type(layer)(*(None if t is None else t.to(self.device) for t in layer))
        backend = TritonAttentionBackend(window, softcap)
        out = backend.forward(q, k.to(self.dtype), v.to(self.dtype), on_device, meta, SCALE)
        assert out.dtype == self.dtype and out.shape == q.shape
        out = out.cpu()
        if padding_after is not None:
            assert torch.equal(out[starts[padding_after]], torch.zeros_like(out[0]))
            out = torch.cat([out[: starts[padding_after]], out[starts[padding_after] + 1 :]])
            starts = [s for s in starts if s <= starts[padding_after]] + [s - 1 for s in starts[padding_after + 2 :]]
        return [out[starts[i] : starts[i + 1]] for i in range(len(spans))]

    def expected(self, span: Span, window: int | None, softcap: float | None = None) -> torch.Tensor:
        """Float64 causal attention of the span's query rows over its sequence's keys [0, last)."""
        seq, first, last = span
        q = self.queries[seq][first:last].double()
        heads, kv_heads = q.shape[1], self.keys[seq].shape[1]
        k = self.keys[seq][:last].double().repeat_interleave(heads // kv_heads, dim=1)
        v = self.values[seq][:last].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(first, last).view(-1, 1)
        key_pos = torch.arange(last).view(1, -1)
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


MIXED = [(0, 0, 21), (1, 159, 160), (2, 60, 100), (3, 0, 1), (4, 64, 65), (5, 20, 21)]
MIXED_LENGTHS = [21, 160, 100, 1, 65, 21]


def check_against_dense(
    seqs: Sequences, spans: list[Span], window: int | None, atol: float, **run: object
) -> list[torch.Tensor]:
    """Run the spans and compare every span's rows with float64 attention."""
    outs = seqs.run(spans, window, **run)  # type: ignore[arg-type]
    softcap = run.get("softcap")
    for span, out in zip(spans, outs, strict=True):
        expected = seqs.expected(span, window, softcap)  # type: ignore[arg-type]
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol, msg=str(span))
    return outs


@pytest.mark.parametrize(
    ("heads", "kv_heads", "window"),
    [
        (2, 2, None),  # one query head a KV head, no window
        pytest.param(2, 2, 90, marks=COMPILED_ONLY),
        pytest.param(4, 2, 5, marks=COMPILED_ONLY),
        pytest.param(4, 2, None, marks=COMPILED_ONLY),
        (4, 1, 90),  # a group of four, a window wider than a partition
        (3, 1, 5),  # a group that is no power of two, a window narrower than a block
    ],
)
def test_matches_dense_attention(device: str, mode: str, heads: int, kv_heads: int, window: int | None) -> None:
    seqs = Sequences(MIXED_LENGTHS, heads=heads, kv_heads=kv_heads, device=device, seed=heads + kv_heads)
    check_against_dense(seqs, MIXED, window, atol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "kv", "window", "atol"),
    [
        (torch.float16, "float16", None, 1e-2),
        pytest.param(torch.bfloat16, "bfloat16", None, 3e-2, marks=COMPILED_ONLY),
        (torch.bfloat16, "bfloat16", 70, 3e-2),
        (torch.float32, "bfloat16", 70, 1e-5),  # a 16-bit cache under a float32 model: widened exactly
        pytest.param(torch.float32, "float16", None, 1e-5, marks=COMPILED_ONLY),
        (torch.bfloat16, "float32", None, 3e-2),
        (torch.float32, "q8_0", None, 1e-5),  # scale * value, exact in float32
        pytest.param(torch.float32, "q8_0", 70, 1e-5, marks=COMPILED_ONLY),
        (torch.bfloat16, "q8_0", None, 3e-2),
    ],
)
def test_kv_formats_and_half_precision(
    device: str, dtype: torch.dtype, kv: str, window: int | None, atol: float
) -> None:
    seqs = Sequences(MIXED_LENGTHS, head_dim=32, dtype=dtype, kv=kv, device=device)
    check_against_dense(seqs, MIXED, window, atol=atol)


@pytest.mark.parametrize(
    ("softcap", "window"),
    [(0.4, 90), pytest.param(1.0, None, marks=COMPILED_ONLY), pytest.param(50.0, 5, marks=COMPILED_ONLY)],
)
def test_soft_capped_scores_match_dense_attention(device: str, mode: str, softcap: float, window: int | None) -> None:
    """Gemma 2's cap * tanh(score / cap): scores of standard deviation ~1.2 on both sides of the tanh's switch
    (|score / cap| = 0.55) and in its flat ends."""
    seqs = Sequences(MIXED_LENGTHS, heads=4, kv_heads=2, device=device, seed=3)
    capped = check_against_dense(seqs, MIXED, window, atol=1e-5, softcap=softcap)
    uncapped = seqs.run(MIXED, window)
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(capped, uncapped, strict=True))


@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 8), (80, 16), (256, 32)])
def test_head_dims_and_block_sizes(device: str, mode: str, head_dim: int, block_size: int) -> None:
    seqs = Sequences([150, 5], heads=4, kv_heads=1, head_dim=head_dim, block_size=block_size, device=device)
    check_against_dense(seqs, [(0, 120, 150), (1, 4, 5)], window=None, atol=1e-5)


def test_int32_block_tables(device: str) -> None:
    seqs = Sequences(MIXED_LENGTHS, device=device)
    check_against_dense(seqs, MIXED, None, atol=1e-5, index_dtype=torch.int32)


@pytest.mark.parametrize(
    ("dtype", "kv", "window", "softcap"),
    [
        (torch.float32, "float32", 40, None),  # float32 tiles, a window over partitions (interpreted too)
        pytest.param(torch.float32, "float32", None, None, marks=COMPILED_ONLY),  # the whole context split
        pytest.param(torch.bfloat16, "bfloat16", 40, None, marks=COMPILED_ONLY),  # 16-bit tiles (their order: same)
        pytest.param(torch.float32, "q8_0", 40, None, marks=COMPILED_ONLY),  # the quantized cache's dequantization
        pytest.param(torch.float32, "float16", 40, 1.0, marks=COMPILED_ONLY),  # soft-capped scores
    ],
)
def test_a_row_is_bitwise_the_same_whatever_shares_its_step(
    device: str,
    dtype: torch.dtype,
    kv: str,
    window: int | None,
    softcap: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    length = 150
    seqs = Sequences([length, 50, 140], heads=4, kv_heads=1, head_dim=32, dtype=dtype, kv=kv, device=device, seed=7)

    def rows(first: int, last: int, *others: Span, split: bool, padding_after: int | None = None) -> torch.Tensor:
        """Sequence 0's rows [first, last), computed in a step with other spans around it, split or folded."""
        monkeypatch.setattr(triton_backend, "SPLIT_MAX_PROGRAMS", 1 << 30 if split else 0)
        spans = [*others[:1], (0, first, last), *others[1:]]
        return seqs.run(spans, window, padding_after=padding_after, softcap=softcap)[1 if others else 0]

    prefill = rows(0, length, split=False)
    for row in (0, 41, 63, 64, 149):  # decodes: tile, window and partition edges
        assert torch.equal(rows(row, row + 1, split=True), prefill[row : row + 1]), row
        assert torch.equal(rows(row, row + 1, split=False), prefill[row : row + 1]), row
    for chunks, split in (([0, 50, 130, 150], True), ([0, 1, 129, 150], False)):  # a prompt prefilled in chunks
        out = torch.cat([rows(first, last, split=split) for first, last in itertools.pairwise(chunks)])
        assert torch.equal(out, prefill), chunks
    beside = rows(100, 140, (1, 0, 50), (2, 139, 140), split=True)  # beside another prefill and a decode
    assert torch.equal(beside, prefill[100:140])
    assert torch.equal(rows(3, 70, (1, 49, 50), split=True, padding_after=1), prefill[3:70])


def test_grid_bounds_far_above_the_lengths_and_padding_sequences(device: str, mode: str) -> None:
    seqs = Sequences([30, 140], device=device, seed=3)
    alone = [seqs.run([span])[0] for span in [(0, 29, 30), (1, 100, 140)]]
    for padding_after in (0, 2):
        outs = seqs.run([(0, 29, 30), (1, 100, 140)], padding_after=padding_after, max_seq_len=1024)
        assert all(torch.equal(a, b) for a, b in zip(outs, alone, strict=True)), padding_after


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "q8_0"])
def test_store_writes_only_real_slots_as_the_reference_store_does(device: str, kv: str) -> None:
    kv_heads, head_dim, block_size = 2, 64, 8
    cache = KVCache(1, 4, block_size, kv_heads, head_dim, kv, "cpu")
    fill_with_noise(cache, torch.Generator().manual_seed(0))
    reference = KVCache(1, 4, block_size, kv_heads, head_dim, kv, "cpu")
    for (plane, _), (noise, _) in zip(reference.layers[0].planes(), cache.layers[0].planes(), strict=True):
        plane.copy_(noise)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(4, kv_heads, head_dim, generator=gen)
    v = torch.randn(4, kv_heads, head_dim, generator=gen)
    if kv == "bfloat16":  # the interpreter truncates to bfloat16: values it holds exactly
        k, v = k.bfloat16().float(), v.bfloat16().float()
    slots = [3 * block_size + 5, -1, 1 * block_size + 0, -1]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=torch.tensor([[3, 1]], device=device),
        query_lens=[4],
        seq_lens=[4],
        query_start=[0, 4],
        seq_lens_tensor=torch.tensor([0], dtype=torch.int32, device=device),  # attend nothing: only the store
        query_start_tensor=torch.tensor([0, 4], dtype=torch.int32, device=device),
        max_query_len=4,
        max_seq_len=4,
    )
    q = torch.randn(4, 4, head_dim, device=device)
    layer = type(cache.layers[0])(*(None if t is None else t.to(device) for t in cache.layers[0]))
    TritonAttentionBackend().forward(q, k.to(device), v.to(device), layer, meta, SCALE)
    reference.layers[0].store(k[[0, 2]], v[[0, 2]], torch.tensor([slots[0], slots[2]]))
    for (ours, _), (theirs, _) in zip(layer.planes(), reference.layers[0].planes(), strict=True):
        assert torch.equal(ours.cpu().view(torch.uint8), theirs.view(torch.uint8))


def test_strided_inputs_are_read_in_place(device: str) -> None:
    heads, kv_heads, head_dim, length = 4, 2, 16, 40
    qkv = torch.randn(length, (heads + 2 * kv_heads) * head_dim, device=device)
    q, k, v = (part.view(length, -1, head_dim) for part in qkv.split([heads * head_dim, *[kv_heads * head_dim] * 2], 1))
    assert not q.is_contiguous()
    meta = AttentionMetadata(
        slot_mapping=torch.arange(length, device=device),
        block_tables=torch.arange(3, device=device).view(1, 3),
        query_lens=[length],
        seq_lens=[length],
        query_start=[0, length],
        seq_lens_tensor=torch.tensor([length], dtype=torch.int32, device=device),
        query_start_tensor=torch.tensor([0, length], dtype=torch.int32, device=device),
        max_query_len=length,
        max_seq_len=length,
    )
    strided = TritonAttentionBackend().forward(
        q, k, v, KVCache(1, 3, 16, kv_heads, head_dim, "float32", device).layers[0], meta, SCALE
    )
    contiguous = TritonAttentionBackend().forward(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        KVCache(1, 3, 16, kv_heads, head_dim, "float32", device).layers[0],
        meta,
        SCALE,
    )
    assert torch.equal(strided, contiguous)


def test_workspace_grows_and_keeps_outgrown_buffers(device: str) -> None:
    backend = TritonAttentionBackend()
    on = torch.empty(0, device=device).device  # as the backend is called: a tensor's device ("cuda:0", not "cuda")
    small = backend._workspace_for(100, on)
    assert backend._workspace_for(50, on).data_ptr() == small.data_ptr()
    backend._workspace_for(1000, on)
    assert any(buffer.data_ptr() == small.data_ptr() for buffer in backend._retired)
