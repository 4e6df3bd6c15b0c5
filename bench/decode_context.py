"""Decode step time against context length, on the engine alone (no HTTP): does long context stay cheap?

Usage: .venv/bin/python -m bench.decode_context [--contexts 128,2048] [--batch 1,16] [--steps 20]
The issue's target: decode at 2,048 tokens of context within 2x the time of decode at 128.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import machine_report
from statelm.config import EngineConfig
from statelm.engine.builder import create_engine
from statelm.engine.engine import Engine
from statelm.engine.sequence import SamplingParams
from statelm.models.layers import RowChunking
from statelm.models.loader import LoadedModel, load_model


def step_times(loaded: LoadedModel, context: int, batch: int, steps: int) -> list[float]:
    """Seconds per decode step for `batch` sequences whose contexts hold `context` tokens."""
    engine: Engine = create_engine(
        loaded, EngineConfig(kv_cache_memory=1 << 30, max_num_batched_tokens=4096, enable_prefix_caching=False)
    )
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 1000 + 100 for j in range(context)], params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(seq.num_uncomputed_tokens > 1 for seq in scheduler.running):
        engine.step()  # prefill
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="128,2048")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    print(machine_report())
    chunking = RowChunking.batch_invariant()
    print(f"settings: default model, {args.dtype}, {chunking}, {args.steps} timed steps, median reported")
    loaded = load_model("default", torch.device("cpu"), getattr(torch, args.dtype), chunking=chunking)
    contexts = [int(c) for c in args.contexts.split(",")]
    for batch in (int(b) for b in args.batch.split(",")):
        medians = {c: statistics.median(step_times(loaded, c, batch, args.steps)) for c in contexts}
        base = medians[contexts[0]]
        cells = ", ".join(f"ctx {c}: {m * 1000:.1f} ms ({m / base:.2f}x)" for c, m in medians.items())
        print(f"batch {batch}: {cells}")


if __name__ == "__main__":
    main()
