"""Storage of the paged KV cache: per layer, a pool of fixed-size blocks of keys and values.

Per layer and block of S tokens (H KV heads, head dim D), in the layout the attention kernels read in place:

    keys    [blocks, H, D, S]   transposed per block: one head's S keys of each dimension are contiguous
    values  [blocks, H, S, D]

For q8_0 (statelm.attention.kv_format) keys and values are int8, with float16 scales per 32 values of a token's head:
key scales [blocks, H, D / 32, S], value scales [blocks, H, S, D / 32]. Outside the pool a session's KV is kept as
rows (kv_format's row form), token-major, whatever the layout in here.

On CUDA, copies between the pool and host memory (a session exported, spilled or restored) run on a
side stream through pinned memory, so they never hold up the compute stream's forwards: gather returns
an event to wait on before the host tensors are read, scatter makes the compute stream wait (on the
GPU) for the blocks it fills, and fence_reads makes the compute stream wait for gathers still reading
blocks that are about to be freed, so that no forward overwrites them mid-copy.
"""

from __future__ import annotations

import torch

from statelm.attention.kv_format import KVFormat, kv_format
from statelm.attention.layer_kv import LayerKV


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
        self.layers = [
            LayerKV.allocate(num_blocks, block_size, num_kv_heads, head_dim, self.format, self.device)
            for _ in range(num_layers)
        ]
        self._copy_stream: torch.cuda.Stream | None = None  # side stream of host transfers (CUDA only)
        self._reads: list[tuple[torch.cuda.Event, set[int]]] = []  # gathers in flight and the blocks they read
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)
            for layer in self.layers:
                for plane, _ in layer.planes():
                    plane.record_stream(self._copy_stream)  # allocated on the compute stream, also used on this one

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


def _device_index(blocks: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on the device, copied from pinned memory without a host synchronisation (on the current stream)."""
    return torch.tensor(blocks, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor in pinned memory, as a non-blocking copy to a GPU needs: itself if it is pinned already."""
    return tensor if tensor.is_pinned() else tensor.pin_memory()
