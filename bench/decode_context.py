"""Decode step time against context length, on the engine alone (no HTTP): does long context stay cheap?

Usage: .venv/bin/python -m bench.decode_context [--model default] [--contexts 128,2048,8160] [--batch 1,16]
    [--steps 20] [--kv-cache-dtype auto,float32,q8_0] [--repeats 3]
The model (the default one, or any --model the server takes: a GGUF file's path) loads as the server loads it
(packed GGUF weights, the compute path the start-up self-check picks).
Issue 30's target: decode at 2,048 tokens of context within 1.5x the time of decode at 128, at batch 1 and 16, with
16-bit KV; the figure at 8k reported.

Each sequence's context is the KV of one prefilled prompt, loaded into a session of its own (its own blocks, as
distinct sequences' are) and continued by one new token: one prefill per context length instead of one per
sequence. Timed: the median step of --steps decode steps, over --repeats engines in turn (the spread is printed).
The bound: a step cannot take less than the step at the first context plus the extra KV it reads at the machine's
memory bandwidth (a read of 1 GiB on the kernels' threads, measured in the run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import machine_report, prefilled_session
from statelm.config import EngineConfig
from statelm.engine.builder import create_engine, kv_cache_format, load_engine_model
from statelm.engine.engine import Engine
from statelm.engine.sequence import SamplingParams
from statelm.engine.session_kv import SessionKVData
from statelm.kernels.build import use_kernel_threads
from statelm.models.loader import LoadedModel


def step_times(loaded: LoadedModel, data: SessionKVData, batch: int, steps: int, kv_dtype: str) -> list[float]:
    """Seconds per decode step of `batch` sequences, each continuing its own copy of data's context."""
    engine = engine_for(loaded, kv_dtype, batch * (len(data.tokens) + steps + 48))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.sessions.load(f"s{i}", data)
        engine.add_request(f"r{i}", [*data.tokens, 100 + i], params, f"s{i}")
    scheduler = engine.scheduler
    while scheduler.waiting or any(seq.num_uncomputed_tokens > 1 for seq in scheduler.running):
        engine.step()  # each request's one new token
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


def bytes_per_token(loaded: LoadedModel, kv_dtype: str) -> int:
    """Bytes a token's KV takes in a pool of kv_dtype."""
    config = loaded.config
    return kv_cache_format(kv_dtype, loaded).bytes_per_token(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    )


def engine_for(loaded: LoadedModel, kv_dtype: str, tokens: int) -> Engine:
    """An engine whose pool holds `tokens` tokens (and 4,096 to spare), without prefix caching or drafts.

    Drafts would make a step compute several tokens of a sequence (and end its request early): a step here is one.
    """
    config = EngineConfig(
        kv_cache_memory=(tokens + 4096) * bytes_per_token(loaded, kv_dtype),
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_dtype,
        speculative_tokens=0,
    )
    return create_engine(loaded, config)


def bandwidth(threads: int) -> float:
    """Bytes per second a sum over 1 GiB of float32 reads on `threads` torch threads (the best of three)."""
    x = torch.ones(1 << 28)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return x.numel() * 4 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--contexts", default="128,2048,8160")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    print(machine_report())
    loaded = load_engine_model(EngineConfig(model=args.model))
    create_engine(loaded, EngineConfig(kv_cache_memory=1 << 26))  # runs the self-check: picks the compute path
    model = loaded.model
    threads = use_kernel_threads() if model.compute_path == "kernels" else torch.get_num_threads()
    peak = bandwidth(threads)
    print(f"settings: {loaded.name}, {model.dtype}, compute path {model.compute_path}, {threads} threads; median of "
          f"{args.steps} decode steps, {args.repeats} engines in turn; memory read {peak / 1e9:.1f} GB/s")  # fmt: skip
    contexts = [int(c) for c in args.contexts.split(",")]
    print("| KV cache | batch | context | step ms (spread) | ratio | KV read per step | bound ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kv_dtype in args.kv_cache_dtype.split(","):
        kv_data = {c: prefilled_session(engine_for(loaded, kv_dtype, c + 64), c) for c in contexts}
        per_token, name = bytes_per_token(loaded, kv_dtype), kv_cache_format(kv_dtype, loaded).name
        for batch in (int(b) for b in args.batch.split(",")):
            runs: dict[int, list[float]] = {context: [] for context in contexts}
            for _ in range(args.repeats):
                for context in contexts:
                    times = step_times(loaded, kv_data[context], batch, args.steps, kv_dtype)
                    runs[context].append(statistics.median(times))
            base = statistics.median(runs[contexts[0]])
            for context in contexts:
                median = statistics.median(runs[context])
                read = batch * context * per_token
                bound = (base + (read - batch * contexts[0] * per_token) / peak) / base
                spread = f"{min(runs[context]) * 1000:.1f}-{max(runs[context]) * 1000:.1f}"
                print(f"| {name} | {batch} | {context} | {median * 1000:.1f} ({spread}) | {median / base:.2f}x | "
                      f"{read / 1e6:.0f} MB | {bound:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
