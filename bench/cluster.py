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
(c) A session's next turn after its replica goes: `--replicas 2 --persist-idle-after 2s` (sessions kept, `turn`
    durability). A session with its own long system prompt has two turns; then its replica gets SIGTERM (a drain),
    SIGKILL (a crash), or SIGKILL after the session was idle long enough to be saved; the next turn is sent at once.
    Its time from the signal to the answer and its cached prompt tokens, against the second turn's on the resident
    session.
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
from typing import Any

import httpx

from bench.common import call_times_ms, launch, machine_report

ENGINE_ARGS = ["--model", "default", "--kv-cache-memory", "256MiB", "--threads", "1"]
STATELESS = ["--no-persist-sessions"]  # (a) and (b) keep no sessions
IDLE_SAVE_S = 2.0
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
    times = call_times_ms(call, count, warmup=5)
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


def turn(client: httpx.Client, session_id: str, question: str) -> tuple[float, dict[str, Any]]:
    """One session turn: its time in ms and its usage."""
    body = {"model": "default", "session_id": session_id, "messages": [{"role": "user", "content": question}],
            "max_tokens": 16, "temperature": 0}  # fmt: skip
    started = time.perf_counter()
    usage = client.post("/v1/chat/completions", json=body).raise_for_status().json()["usage"]
    return (time.perf_counter() - started) * 1000, usage


def replicas(client: httpx.Client) -> dict[str, dict[str, Any]]:
    """The router's view of the replicas, by name."""
    return {row["name"]: row for row in client.get("/v1/cluster").raise_for_status().json()["replicas"]}


def migration(client: httpx.Client, case: int, signum: int, idle_s: float) -> tuple[float, float, str]:
    """A session's resident turn time, then its next turn's time from signum to its replica (after idle_s of idleness)
    to the answer; and that turn's cached/prompt tokens."""
    while not all(row["state"] == "live" for row in replicas(client).values()):
        time.sleep(0.5)
    session_id = f"migrated-{case}"
    system = f"You are assistant {case} of the Example Corporation. " + f"Rule {case}: be brief and exact. " * 40
    created = client.post("/v1/sessions", json={"session_id": session_id, "system": system}).raise_for_status()
    pid = replicas(client)[created.headers["x-statelm-replica"]]["pid"]
    turn(client, session_id, "What is the capital of France?")
    resident_ms, _ = turn(client, session_id, "And of Italy?")
    time.sleep(idle_s)
    signalled = time.perf_counter()
    os.kill(pid, signum)
    _, usage = turn(client, session_id, "And of Spain?")
    moved_ms = (time.perf_counter() - signalled) * 1000
    name = created.headers["x-statelm-replica"]
    while replicas(client)[name]["pid"] == pid or replicas(client)[name]["state"] != "live":
        time.sleep(0.5)  # Ray Serve has started it again: the next case finds both replicas serving
    return resident_ms, moved_ms, f"{usage['prompt_tokens_details']['cached_tokens']}/{usage['prompt_tokens']}"


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
    with serving(args.port, STATELESS) as client:
        direct = overhead(client, args.requests)
    with serving(args.port, [*STATELESS, "--replicas", "1"]) as client:
        routed = overhead(client, args.requests)
    print("  request          direct p50/p99    router p50/p99    added p50")
    for name in direct:
        (d50, d99), (r50, r99) = direct[name], routed[name]
        print(f"  {name:15}  {d50:6.2f} / {d99:6.2f}   {r50:6.2f} / {r99:6.2f}   {r50 - d50:+6.2f}")

    conversations = workload(args.system_prompts, args.workload_requests)
    shape = f"{len(conversations)} requests over {args.system_prompts} system prompts"
    print(f"(b) prefix cache hit rate, 2 replicas, {shape}")
    for routing in ["prefix", "round-robin"]:
        with serving(args.port, [*STATELESS, "--replicas", "2", "--routing", routing]) as client:
            rate, mean_ms = hit_rate(client, conversations)
        print(f"  --routing {routing:12} hit rate {rate:6.1%}   mean request {mean_ms:7.1f} ms")

    print(f"(c) a session's next turn after its replica goes, 2 replicas, --persist-idle-after {IDLE_SAVE_S:.0f}s")
    cases = [("SIGTERM (drain)", signal.SIGTERM, 0.0), ("SIGKILL (crash)", signal.SIGKILL, 0.0),
             ("SIGKILL, idle saved", signal.SIGKILL, IDLE_SAVE_S + 1.5)]  # fmt: skip
    with serving(args.port, ["--replicas", "2", "--persist-idle-after", f"{IDLE_SAVE_S}s"]) as client:
        print("  case                  resident turn   signal to answer   cached/prompt tokens")
        for case, (name, signum, idle_s) in enumerate(cases):
            resident_ms, moved_ms, tokens = migration(client, case, signum, idle_s)
            print(f"  {name:20}  {resident_ms:9.0f} ms   {moved_ms:12.0f} ms   {tokens:>16}")
    print(f"load average at end: {' '.join(f'{value:.2f}' for value in os.getloadavg())}")


if __name__ == "__main__":
    main()
