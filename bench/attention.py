"""Attention backends head to head: the C++ paged kernel against the torch reference, on SmolLM2-135M's shapes.

Usage: .venv/bin/python -m bench.attention [--dtype float32] [--kv-cache-dtype float16] [--threads N] [--repeats 30]
           [--heads 9 --kv-heads 3 --head-dim 64] [--contexts 128,2048,8192]
Times one layer's backend.forward (cache write + attention) for decodes at batch 1 and 16 with --contexts tokens of
context, and a 512-token prefill, in one KV format; F.scaled_dot_product_attention on contiguous float32 tensors
(causal, no paging) is the yardstick for the prefill. Medians of --repeats calls after warm-up. The head counts
default to SmolLM2-135M's (Llama-3.2-1B's: --heads 32 --kv-heads 8).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import machine_report, median_ms
from statelm.attention.base import AttentionBackend, AttentionMetadata
from statelm.attention.cpu_kernel import CpuKernelAttentionBackend
from statelm.attention.kv_format import FORMATS
from statelm.attention.reference import TorchAttentionBackend
from statelm.engine.kv_cache import KVCache

BLOCK_SIZE = 16


class Step:
    """One layer's inputs for `batch` sequences of `context` tokens whose last `query_len` are new."""

    def __init__(
        self, batch: int, context: int, query_len: int, dtype: torch.dtype, kv: str, heads: tuple[int, int, int]
    ) -> None:
        num_heads, kv_heads, head_dim = heads
        self.scale = head_dim**-0.5
        gen = torch.Generator().manual_seed(0)
        blocks_per_seq = -(-context // BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq + 1
        self.cache = KVCache(1, num_blocks, BLOCK_SIZE, kv_heads, head_dim, kv, "cpu").layers[0]
        for plane, _ in self.cache.planes():  # every slot written: pages touched, as in a used pool
            plane.copy_(
                torch.randint(-100, 100, plane.shape, generator=gen) * (0.01 if plane.is_floating_point() else 1)
            )
        tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, blocks_per_seq)
        tokens = batch * query_len
        self.q = torch.randn(tokens, num_heads, head_dim, generator=gen).to(dtype)
        self.k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
        self.v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
        positions = torch.arange(context - query_len, context)
        slots = tables[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        self.meta = AttentionMetadata(
            slot_mapping=slots.reshape(-1),
            block_tables=tables,
            query_lens=[query_len] * batch,
            seq_lens=[context] * batch,
            query_start=[i * query_len for i in range(batch + 1)],
        )

    def run(self, backend: AttentionBackend) -> torch.Tensor:
        """One forward of the backend over this step."""
        return backend.forward(self.q, self.k, self.v, self.cache, self.meta, self.scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-dtype", default="float16", choices=list(FORMATS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M's)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--contexts", default="128,2048,8192", help="decode contexts, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    heads = (args.heads, args.kv_heads, args.head_dim)
    contexts = [int(c) for c in args.contexts.split(",")]
    print(machine_report())
    print(
        f"shapes: heads {args.heads}, kv heads {args.kv_heads}, head dim {args.head_dim}, block size {BLOCK_SIZE}; "
        f"{args.dtype}, KV {args.kv_cache_dtype}; {args.threads} threads; median of {args.repeats}"
    )
    kernel, reference = CpuKernelAttentionBackend(), TorchAttentionBackend()
    print(f"{'case':<28}{'kernel ms':>11}{'reference ms':>14}{'speed-up':>10}")
    cases = [(f"decode b={b} ctx={c}", b, c, 1) for b in (1, 16) for c in contexts]
    cases.append(("prefill 512", 1, 512, 512))
    for name, batch, context, query_len in cases:
        step = Step(batch, context, query_len, dtype, args.kv_cache_dtype, heads)
        kernel_ms = median_ms(lambda step=step: step.run(kernel), args.repeats)
        reference_ms = median_ms(lambda step=step: step.run(reference), args.repeats)
        print(f"{name:<28}{kernel_ms:>11.3f}{reference_ms:>14.3f}{reference_ms / kernel_ms:>9.1f}x")
    q, k, v = (torch.randn(1, args.heads, 512, args.head_dim) for _ in range(3))
    sdpa_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), args.repeats)
    print(f"{'prefill 512, SDPA fp32':<28}{sdpa_ms:>11.3f}  (contiguous, causal, no paging: the yardstick)")


if __name__ == "__main__":
    main()
