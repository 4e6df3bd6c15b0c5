"""Storage of the paged KV cache: per layer, a pool of fixed-size blocks of keys and values.

On CUDA, copies between the pool and host memory (a session exported, spilled or restored) run on a
side stream through pinned memory, so they never hold up the compute stream's forwards: gather returns
an event to wait on before the host tensors are read, scatter makes the compute stream wait (on the
GPU) for the blocks it fills, and fence_reads makes the compute stream wait for gathers still reading
blocks that are about to be freed, so that no forward overwrites them mid-copy.
"""

from __future__ import annotations

import math

import numpy as np
import torch


class KVCache:
    """K and V tensors of shape [num_blocks, block_size, num_kv_heads, head_dim] for every layer."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.k = [_zeros(shape, dtype, self.device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, self.device) for _ in range(num_layers)]
        self._copy_stream: torch.cuda.Stream | None = None  # side stream of host transfers (CUDA only)
        self._reads: list[tuple[torch.cuda.Event, set[int]]] = []  # gathers in flight and the blocks they read
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)
            for cache in (*self.k, *self.v):
                cache.record_stream(self._copy_stream)  # allocated on the compute stream, also used on this one

    def copy_block(self, source: int, target: int) -> None:
        """Copy one block's K/V, in every layer, into another block."""
        for cache in (*self.k, *self.v):
            cache[target].copy_(cache[source])

    def gather(
        self, blocks: list[int], num_tokens: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.cuda.Event | None]:
        """K and V of the first num_tokens tokens held in blocks, per layer as CPU tensors [tokens, heads, dim].

        On CUDA the tensors are pinned and still being filled when this returns: the third item is the event
        that completes them (None on the CPU, where the copy is done).
        """
        if self._copy_stream is not None:
            return self._gather_async(self._copy_stream, blocks, num_tokens)
        index = torch.tensor(blocks, dtype=torch.int64, device=self.k[0].device)

        def take(cache: torch.Tensor) -> torch.Tensor:
            rows = cache.index_select(0, index).flatten(0, 1)[:num_tokens]
            return rows.to("cpu", copy=True).contiguous()

        return [take(cache) for cache in self.k], [take(cache) for cache in self.v], None

    def scatter(
        self,
        blocks: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        ready: torch.cuda.Event | None = None,
    ) -> None:
        """Write per-layer K and V [tokens, heads, dim] into blocks, filling them in order.

        On CUDA the copy starts once ready (the event completing keys and values, if any) has fired, and runs
        on the side stream; the compute stream waits for it on the GPU, the host does not.
        """
        if self._copy_stream is not None:
            self._scatter_async(self._copy_stream, blocks, keys, values, ready)
            return
        index = torch.tensor(blocks, dtype=torch.int64, device=self.k[0].device)
        for caches, tensors in ((self.k, keys), (self.v, values)):
            for cache, tensor in zip(caches, tensors, strict=True):
                padded = cache.new_zeros((len(blocks) * self.block_size, *cache.shape[2:]))
                padded[: tensor.shape[0]] = tensor.to(cache.device, cache.dtype)
                cache.index_copy_(0, index, padded.view(len(blocks), self.block_size, *cache.shape[2:]))

    def fence_reads(self, blocks: list[int]) -> None:
        """Before blocks are freed: make later compute-stream work wait (on the GPU) for gathers still reading them."""
        if not self._reads:
            return
        self._forget_finished_reads()
        freed = set(blocks)
        pending = [event for event, read in self._reads if not read.isdisjoint(freed)]
        if pending:
            torch.cuda.current_stream(self.device).wait_event(pending[-1])  # the side stream runs gathers in order

    def _gather_async(
        self, stream: torch.cuda.Stream, blocks: list[int], num_tokens: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.cuda.Event | None]:
        """gather on the side stream into pinned host tensors; returns before the copy is done."""
        if num_tokens == 0:
            keys, values = (
                [torch.empty((0, *c.shape[2:]), dtype=c.dtype) for c in caches] for caches in (self.k, self.v)
            )
            return keys, values, None
        used = blocks[: -(-num_tokens // self.block_size)]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # K/V the compute stream has queued so far
        with torch.cuda.stream(stream):
            index = _device_index(used, self.device)

            def take(cache: torch.Tensor) -> torch.Tensor:
                rows = cache.index_select(0, index).flatten(0, 1)[:num_tokens]
                host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                return host.copy_(rows, non_blocking=True)

            keys, values = [take(cache) for cache in self.k], [take(cache) for cache in self.v]
            done = torch.cuda.Event()
            done.record(stream)
        self._forget_finished_reads()
        self._reads.append((done, set(used)))
        return keys, values, done

    def _forget_finished_reads(self) -> None:
        self._reads = [(event, read) for event, read in self._reads if not event.query()]

    def _scatter_async(
        self,
        stream: torch.cuda.Stream,
        blocks: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        ready: torch.cuda.Event | None,
    ) -> None:
        """scatter from pinned host memory on the side stream; the compute stream waits for it on the GPU."""
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)  # forwards queued before these blocks were freed may still use them
        if ready is not None:
            stream.wait_event(ready)
        with torch.cuda.stream(stream):
            index = _device_index(blocks, self.device)
            shape = (len(blocks), self.block_size, *self.k[0].shape[2:])
            for caches, tensors in ((self.k, keys), (self.v, values)):
                for cache, tensor in zip(caches, tensors, strict=True):
                    padded = cache.new_zeros((len(blocks) * self.block_size, *cache.shape[2:]))
                    padded[: tensor.shape[0]].copy_(_pinned(tensor.to(cache.dtype)), non_blocking=True)
                    cache.index_copy_(0, index, padded.view(shape))
            done = torch.cuda.Event()
            done.record(stream)
        compute.wait_event(done)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one block takes across all layers, K and V."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU from calloc'd pages, which the OS zeroes on first touch rather than at start-up."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    element = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(math.prod(shape) * element, dtype=np.uint8)).view(dtype).view(shape)


def _device_index(blocks: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on the device, copied from pinned memory without a host synchronisation (on the current stream)."""
    return torch.tensor(blocks, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor in pinned memory, as a non-blocking copy to a GPU needs: itself if it is pinned already."""
    return tensor if tensor.is_pinned() else tensor.pin_memory()
