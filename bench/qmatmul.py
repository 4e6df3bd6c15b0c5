"""statelm's quantized matmul kernel alone: GFLOPS on one core for the default model's shapes, per arithmetic.

Usage: .venv/bin/python -m bench.qmatmul [--rows 1,16,512] [--repeats 5]
Random Q4_1 weights of SmolLM2-135M's MLP shapes (1536x576 up, 576x1536 down), each of the kernel's arithmetics
(float32, int8, int16 activations), one kernel thread; the best of --repeats runs of CPU time (thread time), so
other work on the machine moves the figures less than wall time would. Run it with ATEN_CPU_CAPABILITY=avx2 (or
default) to time a smaller CPU class's library.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from bench.common import machine_report
from statelm.kernels.build import load_kernels
from statelm.kernels.quant import ARITHMETICS, BlockMatrix, PackedWeight

SHAPES = ((1536, 576), (576, 1536))


def gflops(weight: PackedWeight, rows: int, arithmetic: str, repeats: int) -> float:
    """Best rate of weight.matmul on `rows` random rows, in GFLOPS of thread time."""
    x = torch.randn(rows, weight.in_features)
    calls = max(1, 2000 // rows)
    weight.matmul(x, arithmetic)
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        for _ in range(calls):
            weight.matmul(x, arithmetic)
        best = min(best, (time.thread_time() - started) / calls)
    return 2 * weight.out_features * weight.in_features * rows / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,512", help="comma-separated activation row counts")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load_kernels()
    torch.ops.statelm.set_num_threads(1)
    torch.set_num_threads(1)
    print(machine_report())
    rows_list = [int(rows) for rows in args.rows.split(",")]
    print("| weight (N x K) | activations | " + " | ".join(f"{rows} rows" for rows in rows_list) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in rows_list) + " |")
    rng = np.random.default_rng(0)
    for n, k in SHAPES:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q4_1)
        weight = PackedWeight([BlockMatrix.of(GGMLQuantizationType.Q4_1, raw, (n, k))])
        for arithmetic in ARITHMETICS:
            rates = [f"{gflops(weight, rows, arithmetic, args.repeats):.0f}" for rows in rows_list]
            print(f"| Q4_1 {n} x {k} | {arithmetic} | " + " | ".join(rates) + " |")


if __name__ == "__main__":
    main()
