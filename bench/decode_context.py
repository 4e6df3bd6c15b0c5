"""Decode step time against context length, on the engine alone (no HTTP): does long context stay cheap?

Usage: .venv/bin/python -m bench.decode_context [--contexts 128,2048] [--batch 1,16] [--steps 20]
The model loads as the server loads it (packed GGUF weights, the compute path the start-up self-check picks).
Issue 11's target: decode at 2,048 tokens of context within 1.5x the time of decode at 128, at batch 1 and 16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import machine_report
from statelm.config import EngineConfig
from statelm.engine.builder import create_engine, load_engine_model
from statelm.engine.engine import Engine
from statelm.engine.sequence import SamplingParams
from statelm.models.loader import LoadedModel


def step_times(loaded: LoadedModel, context: int, batch: int, steps: int, kv_dtype: str) -> list[float]:
    """Seconds per decode step for `batch` sequences whose contexts hold `context` tokens."""
    config = EngineConfig(  # a pool that holds every sequence whole: no preemption while timing
        kv_cache_memory=4 << 30, max_num_batched_tokens=4096, enable_prefix_caching=False, kv_cache_dtype=kv_dtype
    )
    engine: Engine = create_engine(loaded, config)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 1000 + 100 for j in range(context)], params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(seq.num_uncomputed_tokens > 1 for seq in scheduler.running):
        engine.step()  # prefill
    if len(scheduler.running) != batch:
        raise SystemExit(f"only {len(scheduler.running)} of {batch} sequences fit the KV pool")
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
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    print(machine_report())
    loaded = load_engine_model(EngineConfig())
    create_engine(loaded, EngineConfig(kv_cache_memory=1 << 20))  # runs the self-check: picks the compute path
    model = loaded.model
    threads = torch.get_num_threads()
    print(f"settings: default model, {model.dtype}, compute path {model.compute_path}, {threads} threads,")
    print(f"  KV cache {args.kv_cache_dtype}, {args.steps} timed steps, median reported")
    contexts = [int(c) for c in args.contexts.split(",")]
    for batch in (int(b) for b in args.batch.split(",")):
        medians = {
            c: statistics.median(step_times(loaded, c, batch, args.steps, args.kv_cache_dtype)) for c in contexts
        }
        base = medians[contexts[0]]
        cells = ", ".join(f"ctx {c}: {m * 1000:.1f} ms ({m / base:.2f}x)" for c, m in medians.items())
        print(f"batch {batch}: {cells}")


if __name__ == "__main__":
    main()
