"""Replicas on Ray Serve: the router's added latency, and prefix-aware routing against round robin.

Usage: .venv/bin/python -m bench.cluster [--requests 200] [--workload-requests 48] [--system-prompts 4]

(a) Routing overhead: the same requests against `statelm serve` and against `statelm serve --replicas 1` (the
    router in front of one replica of the same engine), one after the other, sequentially: `GET /v1/models` (no
    engine work) and a chat completion of one token on a short prompt the prefix cache holds. p50 and p99 of each,
    and the difference of the p50s: what the router and the Ray Serve hop add.
(b) Prefix cache hit rate: `--replicas 2` with `--routing prefix` and with `--routing round-robin`, each given the
    same workload: --workload-requests chat requests, each one of --system-prompts long system prompts (shuffled,
    seeded) and its own question, one token each. Hit rate = cached prompt tokens / prompt tokens, from the usage
    the server reports; and the mean request time.
Each server is started for its part with a temporary state dir and stopped after it.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from bench.common import launch, machine_report

ENGINE_ARGS = ["--model", "default", "--kv-cache-memory", "256MiB", "--threads", "1", "--no-persist-sessions"]
QUESTION = {"role": "user", "content": "What is the capital of France?"}


@contextmanager
def serving(port: int, extra: list[str]) -> Iterator[httpx.Client]:
    """`statelm serve` with extra flags on port, stopped (SIGTERM, then its whole process group) after."""
    with tempfile.TemporaryDirectory() as state_dir:
        command = [sys.executable, "-m", "statelm", "serve", "--port", str(port), "--state-dir", state_dir]
        process, startup = launch([*command, *ENGINE_ARGS, *extra], port)
        print(f"  started `statelm serve {' '.join(extra)}` in {startup:.0f} s")
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
                yield client
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=180)


def percentiles(call: Callable[[], object], count: int) -> tuple[float, float]:
    """p50 and p99 in milliseconds of count sequential calls (after 5 warm-up calls)."""
    for _ in range(5):
        call()
    times = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))]


def overhead(client: httpx.Client, count: int) -> dict[str, tuple[float, float]]:
    """Latency of a route without engine work and of a one-token chat completion."""
    body = {"model": "default", "messages": [QUESTION], "max_tokens": 1, "temperature": 0}
    return {
        "GET /v1/models": percentiles(lambda: client.get("/v1/models").raise_for_status(), count),
        "chat, 1 token": percentiles(lambda: client.post("/v1/chat/completions", json=body).raise_for_status(), count),
    }


def workload(system_prompts: int, requests: int) -> list[list[dict[str, str]]]:
    """Chat requests sharing a few long system prompts, in a seeded random order."""
    systems = [
        f"You are assistant number {index} of the Example Corporation. " + f"Policy {index}: be brief and exact. " * 40
        for index in range(system_prompts)
    ]
    rng = random.Random(0)
    return [
        [{"role": "system", "content": rng.choice(systems)}, {"role": "user", "content": f"Question {n}: hello?"}]
        for n in range(requests)
    ]


def hit_rate(client: httpx.Client, conversations: list[list[dict[str, str]]]) -> tuple[float, float]:
    """Cached share of prompt tokens over the workload, and the mean request time in ms."""
    prompt = cached = 0
    started = time.perf_counter()
    for messages in conversations:
        body = {"model": "default", "messages": messages, "max_tokens": 1, "temperature": 0}
        usage = client.post("/v1/chat/completions", json=body).raise_for_status().json()["usage"]
        prompt += usage["prompt_tokens"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
    return cached / prompt, (time.perf_counter() - started) * 1000 / len(conversations)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--requests", type=int, default=200, help="timed requests per overhead figure")
    parser.add_argument("--workload-requests", type=int, default=48)
    parser.add_argument("--system-prompts", type=int, default=4)
    args = parser.parse_args()
    print(machine_report())
    print(f"load average at start: {' '.join(f'{value:.2f}' for value in os.getloadavg())} (a shared machine)")
    print(f"engine: {' '.join(ENGINE_ARGS)}")

    print(f"(a) routing overhead, {args.requests} sequential requests each (ms)")
    with serving(args.port, []) as client:
        direct = overhead(client, args.requests)
    with serving(args.port, ["--replicas", "1"]) as client:
        routed = overhead(client, args.requests)
    print("  request          direct p50/p99    router p50/p99    added p50")
    for name in direct:
        (d50, d99), (r50, r99) = direct[name], routed[name]
        print(f"  {name:15}  {d50:6.2f} / {d99:6.2f}   {r50:6.2f} / {r99:6.2f}   {r50 - d50:+6.2f}")

    conversations = workload(args.system_prompts, args.workload_requests)
    shape = f"{len(conversations)} requests over {args.system_prompts} system prompts"
    print(f"(b) prefix cache hit rate, 2 replicas, {shape}")
    for routing in ["prefix", "round-robin"]:
        with serving(args.port, ["--replicas", "2", "--routing", routing]) as client:
            rate, mean_ms = hit_rate(client, conversations)
        print(f"  --routing {routing:12} hit rate {rate:6.1%}   mean request {mean_ms:7.1f} ms")
    print(f"load average at end: {' '.join(f'{value:.2f}' for value in os.getloadavg())}")


if __name__ == "__main__":
    main()
