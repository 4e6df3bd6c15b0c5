"""Storage of the paged KV cache: per layer, a pool of fixed-size blocks of keys and values.

Per layer and block of S tokens (H KV heads, head dim D), in the layout the attention kernels read in place:

    keys    [blocks, H, D, S]   transposed per block: one head's S keys of each dimension are contiguous
    values  [blocks, H, S, D]

For q8_0 (statelm.engine.kv_format) keys and values are int8, with float16 scales per 32 values of a token's head:
key scales [blocks, H, D / 32, S], value scales [blocks, H, S, D / 32]. Outside the pool a session's KV is kept as
rows (kv_format's row form), token-major, whatever the layout in here.

On CUDA, copies between the pool and host memory (a session exported, spilled or restored) run on a
side stream through pinned memory, so they never hold up the compute stream's forwards: gather returns
an event to wait on before the host tensors are read, scatter makes the compute stream wait (on the
GPU) for the blocks it fills, and fence_reads makes the compute stream wait for gathers still reading
blocks that are about to be freed, so that no forward overwrites them mid-copy.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from statelm.engine.kv_format import (
    Q8_GROUP,
    KVFormat,
    dequantize_q8_0,
    kv_format,
    pack_q8_0,
    quantize_q8_0,
    unpack_q8_0,
)


class LayerKV(NamedTuple):
    """One layer's block tensors (scales only for q8_0)."""

    k: torch.Tensor  # [blocks, H, D, S]
    v: torch.Tensor  # [blocks, H, S, D]
    k_scale: torch.Tensor | None = None  # [blocks, H, D / 32, S] float16
    v_scale: torch.Tensor | None = None  # [blocks, H, S, D / 32] float16

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.v.shape[2]

    def planes(self) -> list[tuple[torch.Tensor, bool]]:
        """Every block tensor with whether it is transposed (token axis last), keys' first."""
        planes = [(self.k, True), (self.v, False)]
        if self.k_scale is not None and self.v_scale is not None:
            planes += [(self.k_scale, True), (self.v_scale, False)]
        return planes

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write K and V [T, H, D] of the model into slots (block * S + offset), rounded or quantized (torch ops)."""
        size = self.block_size
        blocks, offsets = slots // size, slots % size
        if self.k_scale is None:
            self.k[blocks, :, :, offsets] = k.to(self.k.dtype)
            self.v[blocks, :, offsets, :] = v.to(self.v.dtype)
            return
        planes = self.planes()
        for rows, (cache, transposed), (scales, _) in zip((k, v), planes[:2], planes[2:], strict=True):
            values, scale = quantize_q8_0(rows)
            if transposed:
                cache[blocks, :, :, offsets], scales[blocks, :, :, offsets] = values, scale
            else:
                cache[blocks, :, offsets, :], scales[blocks, :, offsets, :] = values, scale

    def values_of(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [len(index) * S, H, D] of blocks, as stored (float formats) or dequantized to float32 (q8_0)."""
        k, v = (_token_major(plane[index], transposed) for plane, transposed in self.planes()[:2])
        if self.k_scale is None:
            return k, v
        k_scale, v_scale = (_token_major(plane[index], transposed) for plane, transposed in self.planes()[2:])
        return dequantize_q8_0(k, k_scale), dequantize_q8_0(v, v_scale)

    def rows(self, index: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows (kv_format's row form) of the first num_tokens tokens in blocks, on the cache's device."""
        tensors = [_token_major(plane[index], transposed)[:num_tokens] for plane, transposed in self.planes()]
        if self.k_scale is None:
            return tensors[0].contiguous(), tensors[1].contiguous()
        return pack_q8_0(tensors[0], tensors[2]), pack_q8_0(tensors[1], tensors[3])

    def write_rows(self, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fill blocks, in order, with K and V rows (the pool's format, on its device); unused slots become 0."""
        if self.k_scale is None:
            tensors = [keys, values]
        else:
            (k, k_scale), (v, v_scale) = unpack_q8_0(keys), unpack_q8_0(values)
            tensors = [k, v, k_scale, v_scale]
        count, size = len(index), self.block_size
        for (plane, transposed), rows in zip(self.planes(), tensors, strict=True):
            padded = plane.new_zeros((count * size, *rows.shape[1:]))
            padded[: rows.shape[0]] = rows
            blocks = padded.view(count, size, *rows.shape[1:])
            plane.index_copy_(0, index, blocks.permute(0, 2, 3, 1) if transposed else blocks.transpose(1, 2))


def _token_major(blocks: torch.Tensor, transposed: bool) -> torch.Tensor:
    """[n * S, H, X] rows of block tensors [n, H, X, S] (transposed) or [n, H, S, X]."""
    rows = blocks.permute(0, 3, 1, 2) if transposed else blocks.transpose(1, 2)
    return rows.reshape(-1, *rows.shape[2:])


class KVCache:
    """The blocks of every layer (LayerKV), in one KV format."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str | KVFormat,
        device: torch.device | str,
    ) -> None:
        self.format = kv_format(dtype)
        self.format.check_head_dim(head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.layers = [self._new_layer() for _ in range(num_layers)]
        self._copy_stream: torch.cuda.Stream | None = None  # side stream of host transfers (CUDA only)
        self._reads: list[tuple[torch.cuda.Event, set[int]]] = []  # gathers in flight and the blocks they read
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)
            for layer in self.layers:
                for plane, _ in layer.planes():
                    plane.record_stream(self._copy_stream)  # allocated on the compute stream, also used on this one

    def _new_layer(self) -> LayerKV:
        blocks, size, heads, dim = self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        element = self.format.element
        k = _zeros((blocks, heads, dim, size), element, self.device)
        v = _zeros((blocks, heads, size, dim), element, self.device)
        if not self.format.quantized:
            return LayerKV(k, v)
        groups = dim // Q8_GROUP
        k_scale = _zeros((blocks, heads, groups, size), torch.float16, self.device)
        v_scale = _zeros((blocks, heads, size, groups), torch.float16, self.device)
        return LayerKV(k, v, k_scale, v_scale)

    @property
    def k(self) -> list[torch.Tensor]:
        """Every layer's key blocks."""
        return [layer.k for layer in self.layers]

    @property
    def v(self) -> list[torch.Tensor]:
        """Every layer's value blocks."""
        return [layer.v for layer in self.layers]

    @property
    def k_scale(self) -> list[torch.Tensor]:
        """Every layer's key scales (q8_0; empty for float formats)."""
        return [layer.k_scale for layer in self.layers if layer.k_scale is not None]

    @property
    def v_scale(self) -> list[torch.Tensor]:
        """Every layer's value scales (q8_0; empty for float formats)."""
        return [layer.v_scale for layer in self.layers if layer.v_scale is not None]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's K and V take in the pool, all layers."""
        return self.format.bytes_per_token(len(self.layers), self.num_kv_heads, self.head_dim)

    def copy_block(self, source: int, target: int) -> None:
        """Copy one block's K/V, in every layer, into another block."""
        for layer in self.layers:
            for plane, _ in layer.planes():
                plane[target].copy_(plane[source])

    def gather(
        self, blocks: list[int], num_tokens: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.cuda.Event | None]:
        """K and V rows of the first num_tokens tokens held in blocks, per layer as CPU tensors (kv_format's rows).

        On CUDA the tensors are pinned and still being filled when this returns: the third item is the event
        that completes them (None on the CPU, where the copy is done).
        """
        if self._copy_stream is not None and num_tokens:
            return self._gather_async(self._copy_stream, blocks, num_tokens)
        index = torch.tensor(blocks[: -(-num_tokens // self.block_size)], dtype=torch.int64, device=self.device)
        rows = [layer.rows(index, num_tokens) for layer in self.layers]
        return [k.to("cpu", copy=True) for k, _ in rows], [v.to("cpu", copy=True) for _, v in rows], None

    def scatter(
        self,
        blocks: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        ready: torch.cuda.Event | None = None,
    ) -> None:
        """Write per-layer K and V rows (the pool's format) into blocks, filling them in order.

        On CUDA the copy starts once ready (the event completing keys and values, if any) has fired, and runs
        on the side stream; the compute stream waits for it on the GPU, the host does not.
        """
        wrong = {str(rows.dtype) for rows in (*keys, *values) if rows.dtype != self.format.row_dtype}
        if wrong:
            raise ValueError(f"K/V rows of {', '.join(sorted(wrong))} do not fit a {self.format.name} pool")
        if self._copy_stream is not None:
            self._scatter_async(self._copy_stream, blocks, keys, values, ready)
            return
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            layer.write_rows(index, k, v)

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
        used = blocks[: -(-num_tokens // self.block_size)]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # K/V the compute stream has queued so far
        with torch.cuda.stream(stream):
            index = _device_index(used, self.device)

            def to_host(rows: torch.Tensor) -> torch.Tensor:
                host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                return host.copy_(rows, non_blocking=True)

            rows = [layer.rows(index, num_tokens) for layer in self.layers]
            keys, values = [to_host(k) for k, _ in rows], [to_host(v) for _, v in rows]
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
            for layer, k, v in zip(self.layers, keys, values, strict=True):
                on_device = [_pinned(rows).to(self.device, non_blocking=True) for rows in (k, v)]
                layer.write_rows(index, *on_device)
            done = torch.cuda.Event()
            done.record(stream)
        compute.wait_event(done)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype | str | KVFormat
    ) -> int:
        """Memory one block takes across all layers, K and V (scales included)."""
        return block_size * kv_format(dtype).bytes_per_token(num_layers, num_kv_heads, head_dim)


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
