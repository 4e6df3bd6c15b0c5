"""What a draft's rows cost: one forward of a decoding sequence's last token and M-1 draft tokens, against one row.

Usage: .venv/bin/python -m bench.draft_rows [--model PATH] [--rows 1,2,3,5,8] [--repeats 7]
In process, on the model as the server loads it: a sequence is prefilled (67 tokens) and decodes a few tokens,
then for each M the step's forward (the model runner, logits of every row) is timed with M generated rows of that
sequence, the median of --repeats. A draft of M-1 tokens pays off when more than (time of M rows / time of one row
- 1) of its tokens are taken on average.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import machine_report
from statelm.config import EngineConfig
from statelm.engine.builder import create_engine, load_engine_model
from statelm.engine.scheduler import ScheduledChunk
from statelm.engine.sequence import SamplingParams


def main() -> None:
    """Time the forwards and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", default="1,2,3,5,8", help="rows of the sequence in a step (1: no draft)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    config = EngineConfig(model=args.model, kv_cache_memory=256 << 20, speculative_tokens=0)
    engine = create_engine(load_engine_model(config), config)
    print(machine_report(), f"model: {args.model}", sep="\n", flush=True)
    engine.add_request(
        "r", [(31 * j) % 4000 + 100 for j in range(67)], SamplingParams(temperature=0.0, max_tokens=4000)
    )
    for _ in range(3):
        engine.step()
    (seq,) = engine.scheduler.running
    times: dict[int, float] = {}
    for rows in (int(text) for text in args.rows.split(",")):
        seq.draft = [(7 * j) % 3000 + 50 for j in range(rows - 1)]
        assert engine.kv.grow(seq.block_table, seq.num_tokens + len(seq.draft))
        samples = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            engine.runner.execute([ScheduledChunk(seq, rows)])
            samples.append(time.perf_counter() - started)
        times[rows] = statistics.median(samples) * 1000
    seq.draft = []
    one = times.get(1) or min(times.values())
    print("\n| rows (1 + draft tokens) | step (ms) | against one row |\n| ---: | ---: | ---: |")
    for rows, ms in times.items():
        print(f"| {rows} | {ms:.1f} | {ms / one:.2f}x |")


if __name__ == "__main__":
    main()
