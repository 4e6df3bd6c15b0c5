"""The GGUF matmul at decode's few rows: weight GB/s per block format and row count, one and two kernel threads.

Usage: .venv/bin/python -m bench.qdecode [--formats Q4_K,Q6_K,...] [--rows 1,2,4,8] [--threads 1,2] [--mib 192]
           [--shape 2048x2048] [--arithmetic int8] [--repeats 5] [--gguf FILE] [--layout interleaved|in-place]
For each format, random blocks (every level and sub-scale bit random, tests/unit/gguf_blocks.py) of several
matrices of --shape [out x in] that together hold about --mib MiB, more than the last-level cache, so that every
call reads its weights from memory as a decode step of a 1B+ model does; one call per matrix in turn, timed in
wall time, best of --repeats passes. The rate is the weights' bytes over the time: decode is bound by it. Run it
with ATEN_CPU_CAPABILITY=avx2 (or default) to time a smaller CPU class's library. With --gguf, instead: every
quantized matrix of that file (mapped, as the server maps it), each once per pass as a decode step calls them: ms
a step and GB/s. --layout: the blocks interleaved at load as the server does by default (--repack), or read in
place from the file as it stores them (--no-repack); the rate counts the file's bytes either way.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from bench.common import machine_report
from statelm.kernels.build import load_kernels, loaded_library
from statelm.kernels.quant import ARITHMETICS, BLOCK_TYPES, BlockMatrix, PackedWeight
from statelm.models.gguf_file import GGUFFile
from tests.unit.gguf_blocks import random_blocks

DEFAULT_FORMATS = "Q4_K,Q5_K,Q6_K,Q8_0,Q4_0,Q4_1,IQ4_NL,IQ4_XS"


def weights_of(qtype: GGMLQuantizationType, shape: tuple[int, int], mib: float) -> list[PackedWeight]:
    """Random matrices of the format and shape holding about `mib` MiB of blocks together."""
    rows, cols = shape
    values, size = GGML_QUANT_SIZES[qtype]
    count = max(1, round(mib * 2**20 / (rows * cols // values * size)))
    rng = np.random.default_rng(int(qtype))
    return [PackedWeight([BlockMatrix.of(qtype, random_blocks(qtype, rows, cols, rng), shape)]) for _ in range(count)]


def laid_out(weights: list[PackedWeight], layout: str) -> list[PackedWeight]:
    """The weights as --layout says: interleaved copies, or the blocks in place."""
    return [weight.interleave() if layout == "interleaved" else weight for weight in weights]


def rate(weights: list[PackedWeight], rows: int, arithmetic: str, repeats: int) -> float:
    """Best pass over every matrix, in GB/s of weight bytes (wall time)."""
    x = torch.randn(rows, weights[0].in_features)
    for weight in weights:
        weight.matmul(x, arithmetic)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for weight in weights:
            weight.matmul(x, arithmetic)
        best = min(best, time.perf_counter() - started)
    return sum(weight.nbytes for weight in weights) / best / 1e9


def memory_rates(mib: float, threads_list: list[int], repeat_each: int) -> list[str]:
    """The machine's read rate over as many bytes as a format's matrices hold: torch.sum of float32, per thread
    count (the reference the kernels' rates approach when they are bound by memory)."""
    data = torch.rand(int(mib * 2**20) // 4)
    rates = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - started)
        rates += [f"{data.numel() * 4 / best / 1e9:.1f}"] * repeat_each
    torch.set_num_threads(1)
    return rates


def gguf_step(path: Path, rows: int, arithmetic: str, repeats: int, layout: str) -> tuple[float, int]:
    """Best time of one pass over every quantized matrix of the file (seconds), and their bytes."""
    mapped = GGUFFile(path)
    weights = laid_out(
        [
            PackedWeight([BlockMatrix.of(info.qtype, mapped.raw(info), info.shape)])
            for info in mapped.header.tensors.values()
            if info.qtype in BLOCK_TYPES and len(info.shape) == 2
        ],
        layout,
    )
    inputs = {size: torch.randn(rows, size) for size in {weight.in_features for weight in weights}}
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for weight in weights:
            weight.matmul(inputs[weight.in_features], arithmetic)
        best = min(best, time.perf_counter() - started)
    return best, sum(weight.nbytes for weight in weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help="comma-separated GGUF block types")
    parser.add_argument("--rows", default="1,2,4,8", help="comma-separated activation row counts")
    parser.add_argument("--threads", default="1,2", help="comma-separated kernel thread counts")
    parser.add_argument("--shape", default="2048x2048", help="each matrix's out x in")
    parser.add_argument("--mib", type=float, default=192.0, help="MiB of blocks per format, all matrices together")
    parser.add_argument("--arithmetic", default="int8", choices=list(ARITHMETICS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gguf", type=Path, help="time every quantized matrix of this file instead")
    parser.add_argument("--layout", default="interleaved", choices=["interleaved", "in-place"])
    args = parser.parse_args()
    load_kernels()
    torch.set_num_threads(1)
    rows_list = [int(rows) for rows in args.rows.split(",")]
    threads_list = [int(threads) for threads in args.threads.split(",")]
    shape = tuple(int(size) for size in args.shape.split("x"))
    print(machine_report())
    if args.gguf:
        print(
            f"library {loaded_library()}; {args.arithmetic} activations; {args.layout}; every quantized matrix of"
            f" {args.gguf}"
        )
        print("| rows | threads | ms a step | GB/s |\n| ---: | ---: | ---: | ---: |")
        for threads in threads_list:
            torch.ops.statelm.set_num_threads(threads)
            for rows in rows_list:
                seconds, size = gguf_step(args.gguf, rows, args.arithmetic, args.repeats, args.layout)
                print(f"| {rows} | {threads} | {seconds * 1e3:.1f} | {size / seconds / 1e9:.1f} |", flush=True)
        return
    print(
        f"library {loaded_library()}; {args.arithmetic} activations; {args.layout}; {args.mib:g} MiB of"
        f" {shape[0]}x{shape[1]}"
    )
    columns = [f"{rows} row{'s' if rows > 1 else ''}, {threads} thr" for threads in threads_list for rows in rows_list]
    print("| format | " + " | ".join(columns) + " |")
    print("| --- | " + " | ".join("---:" for _ in columns) + " |")
    memory = memory_rates(args.mib, threads_list, len(rows_list))
    print("| memory (torch.sum of as many bytes) | " + " | ".join(memory) + " |")
    for name in args.formats.split(","):
        weights = laid_out(weights_of(GGMLQuantizationType[name], shape, args.mib), args.layout)
        rates = []
        for threads in threads_list:
            torch.ops.statelm.set_num_threads(threads)
            rates += [f"{rate(weights, rows, args.arithmetic, args.repeats):.1f}" for rows in rows_list]
        print(f"| {name} | " + " | ".join(rates) + " |", flush=True)


if __name__ == "__main__":
    main()
