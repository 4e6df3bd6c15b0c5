"""CUDA graphs of the decode step: one captured forward (and LM head) per batch-size bucket.

A decode step of B sequences (one generated token each) replays the graph of the smallest bucket ≥ B over
persistent input buffers; the rows past B are padding (token 0 at position 0, slot -1, context length 0), so
they write no KV and read none. The captured forward is the eager one, with the same kernels and the same
row chunking, so a replay's logits equal an eager step's bit for bit, and a sequence's result does not depend
on the bucket it lands in. Attention sizes its grid from a bound on the context, so one graph serves every
context length up to its bucket's bound (the model's maximum length for batches of up to 8 sequences, at least
16k tokens for larger ones); a longer decode step runs eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from statelm.attention.base import AttentionMetadata

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]  # ids, positions, meta → logits


GRAPH_CONTEXT_TOKENS = 1 << 20  # a bucket's graph serves contexts up to this over its batch size (and at least
MIN_GRAPH_CONTEXT = 16384  # this): attention sizes its grid and split-K workspace for the bound, not the batch


def context_bound(batch: int, max_model_len: int) -> int:
    """The longest context a bucket's graph serves: the model's for small batches, less for large ones."""
    return min(max_model_len, max(MIN_GRAPH_CONTEXT, GRAPH_CONTEXT_TOKENS // batch))


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (and max_num_seqs)."""
    sizes = {size for size in (1, 2, 4, 8) if size <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class DecodeGraphs:
    """Captured decode forwards for batch-size buckets, replayed over persistent input buffers."""

    def __init__(
        self, forward: Forward, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device
    ) -> None:
        self.forward = forward
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        size = self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(size, self.max_blocks, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int64, device=device)
        self.query_start = torch.arange(size + 1, dtype=torch.int64, device=device)
        self.replays: dict[int, Callable[[], None]] = {}  # by bucket
        self.logits: dict[int, torch.Tensor] = {}  # each bucket's output buffer
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._pool: tuple[int, int] | None = None

    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool."""
        started = time.perf_counter()
        for size in reversed(self.buckets):
            self.forward(*self._inputs(size))  # warm-up: kernels compiled and autotuned outside the capture
            self._synchronize()
            self.replays[size], self.logits[size] = self._record(size)
        self._synchronize()
        log.info(
            "CUDA graphs: decode captured for batch sizes %s in %.1f s",
            ",".join(map(str, self.buckets)),
            time.perf_counter() - started,
        )

    def _record(self, size: int) -> tuple[Callable[[], None], torch.Tensor]:
        """Capture one bucket's forward: its replay, and the output buffer each replay refills."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.forward(*self._inputs(size))
        self._graphs.append(graph)
        return graph.replay, logits

    def _synchronize(self) -> None:
        if self.input_ids.device.type == "cuda":
            torch.cuda.synchronize(self.input_ids.device)

    def fits(self, num_seqs: int, max_seq_len: int) -> bool:
        """Whether a decode step of num_seqs sequences, the longest max_seq_len tokens, can replay a graph."""
        if not self.replays or num_seqs > self.buckets[-1]:
            return False
        return max_seq_len <= context_bound(self._bucket(num_seqs), self.max_model_len)

    def _bucket(self, num_seqs: int) -> int:
        return next(bucket for bucket in self.buckets if bucket >= num_seqs)

    def replay(
        self, input_ids: list[int], positions: list[int], block_tables: list[list[int]], seq_lens: list[int]
    ) -> torch.Tensor:
        """Float32 logits [B, vocab] of one decode step of B sequences (a view valid until the next replay)."""
        count = len(input_ids)
        size = self._bucket(count)
        block_size = self.block_size
        width = max(len(table) for table in block_tables)
        tables = torch.zeros(size, width, dtype=torch.int64)
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.int64)
        ids = torch.zeros(size, dtype=torch.int64)
        ids[:count] = torch.tensor(input_ids, dtype=torch.int64)
        pos = torch.zeros(size, dtype=torch.int64)
        pos[:count] = torch.tensor(positions, dtype=torch.int64)
        slots = torch.full((size,), -1, dtype=torch.int64)
        slots[:count] = tables[torch.arange(count), pos[:count] // block_size] * block_size + pos[:count] % block_size
        lens = torch.zeros(size, dtype=torch.int64)
        lens[:count] = torch.tensor(seq_lens, dtype=torch.int64)
        for target, host in (
            (self.input_ids[:size], ids),
            (self.positions[:size], pos),
            (self.slot_mapping[:size], slots),
            (self.block_tables[:size, :width], tables),
            (self.seq_lens[:size], lens),
        ):
            target.copy_(host.pin_memory() if target.is_cuda else host, non_blocking=True)
        self.replays[size]()
        return self.logits[size][:count]

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The persistent buffers of a bucket, with metadata bounded by the bucket's longest context."""
        bound = context_bound(size, self.max_model_len)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_lens=[1] * size,
            seq_lens=[bound] * size,
            query_start=list(range(size + 1)),
            seq_lens_tensor=self.seq_lens[:size],
            query_start_tensor=self.query_start[: size + 1],
            max_query_len=1,
            max_seq_len=bound,
        )
        return self.input_ids[:size], self.positions[:size], meta
