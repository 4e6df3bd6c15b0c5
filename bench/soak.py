"""Soak: mixed stateless, session, snapshot and cancelled requests at fixed concurrency, bounded in time and count.

Usage: .venv/bin/python -m bench.soak [--duration 600] [--concurrency 16] [--max-requests 200000]
                                      [--url URL --pid PID --api-key KEY] [--kv-cache-memory 512MiB]
                                      [--window 30] [--warmup 60] [--leak-threshold 2.0] [--leak-requests]

Each worker repeats one of four scenarios, chosen in turn from a seeded generator:
  stateless  a short chat completion;
  session    create a session, two turns, check its history, delete it;
  snapshot   create a session, one turn, snapshot it, load the snapshot as a second session, one turn there,
             delete the snapshot and both sessions;
  cancelled  a long streamed turn (in a session or stateless) closed after three chunks; the session must
             be left as it was, then it is deleted.
A status other than the scenario expects, or any transport error, is an unexpected error (there must be none).
Without --url it starts `statelm serve --model default` on 127.0.0.1 with an API key and a temporary state
dir, and reads its resident memory from /proc (Linux). At the end it reports the errors and the KV blocks free
(all of them must be: every session was deleted).

Memory (when the server's process id is known). The KV pool is allocated at start but its pages become resident only
as blocks are first used, so a fresh server's memory grows by up to the pool's size with no leak. Before the load the
soak therefore touches the whole pool (stateless prompts of distinct tokens, as many tokens as the pool has room for:
the pool hands out blocks never used before any it has used). Then it samples the resident memory every --window
seconds with the requests done so far; after --warmup seconds (allocator arenas and caches settling) it prints each
window's growth per 1,000 requests, and fits the growth per 1,000 requests over every window after the warm-up and
over the later half of them. The soak fails on memory only if both are above --leak-threshold MiB: growth that goes
on, not a step. Runs too short to have four windows after the warm-up are not judged on memory, and say so.

--leak-requests starts the server with a deliberate leak (bench/leaking_server.py keeps every request object), to
show that the check catches one.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import launch, machine_report
from statelm.config import EngineConfig, parse_size

MIB = 2**20
MIN_JUDGED_WINDOWS = 4

SCENARIOS = ("stateless", "session", "snapshot", "cancelled")
PROMPTS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is two plus two?",
]


class Unexpected(Exception):
    """A response the scenario did not expect."""


@dataclass
class Tally:
    """What the workers did: requests sent, scenarios completed, unexpected errors and a few examples."""

    requests: int = 0
    scenarios: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)


class Soak:
    """Workers that run the scenarios against one server until the deadline or the request budget."""

    def __init__(self, http: httpx.AsyncClient, deadline: float, max_requests: int, seed: int) -> None:
        self.http = http
        self.deadline = deadline
        self.max_requests = max_requests
        self.seed = seed
        self.tally = Tally()

    def running(self) -> bool:
        """Whether time and request budget are left."""
        return time.monotonic() < self.deadline and self.tally.requests < self.max_requests

    async def worker(self, index: int) -> None:
        """Run scenarios one after another."""
        rng = random.Random(self.seed * 1000 + index)
        scenarios: dict[str, Callable[[random.Random], Awaitable[None]]] = {
            "stateless": self.stateless,
            "session": self.session,
            "snapshot": self.snapshot,
            "cancelled": self.cancelled,
        }
        while self.running():
            name = rng.choice(SCENARIOS)
            try:
                await scenarios[name](rng)
                self.tally.scenarios[name] += 1
            except (Unexpected, httpx.HTTPError) as exc:
                self.tally.errors[name] += 1
                if len(self.tally.examples) < 10:
                    self.tally.examples.append(f"{name}: {type(exc).__name__}: {exc}"[:300])

    async def call(self, method: str, path: str, expected: int, body: dict[str, Any] | None = None) -> Any:
        """One request; its JSON body if it has the expected status, else Unexpected."""
        self.tally.requests += 1
        response = await self.http.request(method, path, json=body)
        if response.status_code != expected:
            raise Unexpected(f"{method} {path} -> {response.status_code}: {response.text[:200]}")
        return response.json()

    async def chat(self, rng: random.Random, session_id: str | None = None) -> dict[str, Any]:
        """A short chat completion, stateless or as a session turn."""
        body: dict[str, Any] = {
            "model": "default",
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(4, 16),
            "temperature": rng.choice([0.0, 0.7]),
            "seed": rng.randint(0, 2**31),
        }
        if session_id is not None:
            body["session_id"] = session_id
        return await self.call("POST", "/v1/chat/completions", 200, body)

    async def stateless(self, rng: random.Random) -> None:
        """One stateless request."""
        await self.chat(rng)

    async def session(self, rng: random.Random) -> None:
        """A two-turn session, checked and deleted."""
        session_id = await self.new_session()
        for _ in range(2):
            await self.chat(rng, session_id)
        history = await self.call("GET", f"/v1/sessions/{session_id}/history", 200)
        if [message["role"] for message in history["messages"]] != ["user", "assistant"] * 2:
            raise Unexpected(f"session {session_id} has the wrong history after two turns")
        await self.call("DELETE", f"/v1/sessions/{session_id}", 200)

    async def snapshot(self, rng: random.Random) -> None:
        """Snapshot a session, load it into a second one, continue it there, delete everything."""
        source = await self.new_session()
        await self.chat(rng, source)
        snapshot = await self.call("POST", f"/v1/sessions/{source}/snapshot", 201, {"title": "soak"})
        loaded = await self.call("POST", f"/v1/snapshots/{snapshot['id']}/load", 201, {})
        if loaded["num_messages"] != 2:
            raise Unexpected(f"snapshot {snapshot['id']} loaded with {loaded['num_messages']} messages")
        await self.chat(rng, loaded["id"])
        await self.call("DELETE", f"/v1/snapshots/{snapshot['id']}", 200)
        for session_id in (source, loaded["id"]):
            await self.call("DELETE", f"/v1/sessions/{session_id}", 200)

    async def cancelled(self, rng: random.Random) -> None:
        """A long stream closed after three chunks; a session it ran in is left unchanged."""
        session_id = await self.new_session() if rng.random() < 0.5 else None
        body: dict[str, Any] = {
            "model": "default",
            "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        if session_id is not None:
            body["session_id"] = session_id
        self.tally.requests += 1
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise Unexpected(f"stream -> {response.status_code}")
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break
        if session_id is None:
            return
        for _ in range(200):  # the server notices the disconnect and drops the turn
            state = await self.call("GET", f"/v1/sessions/{session_id}", 200)
            if state["state"] != "busy":
                break
            await asyncio.sleep(0.05)
        if state["num_messages"] != 0:
            raise Unexpected(f"cancelled turn changed session {session_id}: {state}")
        await self.call("DELETE", f"/v1/sessions/{session_id}", 200)

    async def new_session(self) -> str:
        """A fresh session's id."""
        session_id = f"soak-{uuid.uuid4().hex[:12]}"
        await self.call("POST", "/v1/sessions", 201, {"session_id": session_id})
        return session_id


@dataclass(frozen=True)
class MemorySample:
    """The server's resident memory at a moment of the run, and how many requests were sent by then."""

    seconds: float
    requests: int
    rss: int


@dataclass(frozen=True)
class MemoryVerdict:
    """Growth per 1,000 requests fitted over the windows after the warm-up and over their later half (MiB; None:
    too few windows to judge), and whether it goes on above the threshold."""

    judged: list[MemorySample]
    overall: float | None
    recent: float | None
    leaking: bool


def growth_per_1k(samples: list[MemorySample]) -> float:
    """Least-squares slope of resident MiB against thousands of requests."""
    fit = statistics.linear_regression([s.requests / 1000 for s in samples], [s.rss / MIB for s in samples])
    return fit.slope


def memory_verdict(samples: list[MemorySample], warmup_s: float, threshold_mib: float) -> MemoryVerdict:
    """Whether resident memory keeps growing with requests after the warm-up (a leak), rather than stepping once."""
    judged = [sample for sample in samples if sample.seconds >= warmup_s]
    if len(judged) < MIN_JUDGED_WINDOWS or judged[-1].requests == judged[0].requests:
        return MemoryVerdict(judged, None, None, False)
    overall, recent = growth_per_1k(judged), growth_per_1k(judged[len(judged) // 2 :])
    return MemoryVerdict(judged, overall, recent, overall > threshold_mib and recent > threshold_mib)


async def touch_pool(http: httpx.AsyncClient, tokens: int) -> int:
    """Stateless one-token requests on prompts of distinct tokens until `tokens` prompt tokens were computed, four
    at a time; the tokens computed."""
    done = 0
    words = ["river", "stone", "cloud", "ember", "maple", "quartz", "harbor", "violet", "thunder", "meadow"]

    async def one(index: int) -> int:
        rng = random.Random(index)
        text = f"{index}: " + " ".join(rng.choice(words) + str(rng.randint(0, 999)) for _ in range(300))
        body = {"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        response = await http.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        usage = response.json()["usage"]
        return usage["prompt_tokens"] - usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)

    index = 0
    while done < tokens:
        done += sum(await asyncio.gather(*(one(index + offset) for offset in range(4))))
        index += 4
    return done


async def sample_memory(runner: Soak, pid: int, window: float, samples: list[MemorySample]) -> None:
    """Append a sample every window seconds while the soak runs."""
    started = time.monotonic()
    while runner.running():
        await asyncio.sleep(min(window, max(runner.deadline - time.monotonic(), 0.0)))
        samples.append(MemorySample(time.monotonic() - started, runner.tally.requests, rss_bytes(pid)))


def report_memory(samples: list[MemorySample], args: argparse.Namespace) -> bool:
    """Print the windows' growth and the verdict; False on a leak."""
    verdict = memory_verdict(samples, args.warmup, args.leak_threshold)
    print(f"server resident memory every {args.window:.0f} s (KV pool {args.kv_pool_bytes / MIB:.0f} MiB, touched "
          f"before the load; windows before {args.warmup:.0f} s are warm-up):")  # fmt: skip
    for before, after in itertools.pairwise(samples):
        requests, grown = after.requests - before.requests, (after.rss - before.rss) / MIB
        per_1k = f"{grown / requests * 1000:+7.2f} MiB per 1,000 requests" if requests else ""
        warmup = "  (warm-up)" if after.seconds < args.warmup else ""
        print(f"  {after.seconds:6.0f} s  {after.rss / MIB:7.0f} MiB  {grown:+7.1f} MiB over {requests:5d} requests  "
              f"{per_1k}{warmup}")  # fmt: skip
    if verdict.overall is None or verdict.recent is None:
        print(f"memory: not judged ({len(verdict.judged)} samples after the warm-up; {MIN_JUDGED_WINDOWS} needed)")
        return True
    print(f"memory: {verdict.overall:+.2f} MiB per 1,000 requests after the warm-up, {verdict.recent:+.2f} over its "
          f"later half (threshold {args.leak_threshold:.2f}): {'LEAK' if verdict.leaking else 'no leak'}")  # fmt: skip
    return not verdict.leaking


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc."""
    resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def kv_blocks(metrics: str) -> tuple[int, int]:
    """KV blocks used and free, from the Prometheus text."""
    used = re.search(r"^statelm_kv_blocks_used (\S+)$", metrics, re.MULTILINE)
    free = re.search(r"^statelm_kv_blocks_free (\S+)$", metrics, re.MULTILINE)
    if used is None or free is None:
        raise SystemExit("/metrics has no KV block gauges")
    return int(float(used.group(1))), int(float(free.group(1)))


async def soak(url: str, api_key: str, pid: int | None, args: argparse.Namespace) -> bool:
    """Run the soak against url and print the report; True if it passed."""
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as http:
        samples: list[MemorySample] = []
        if pid:
            used, free = kv_blocks((await http.get("/metrics")).text)
            touched = await touch_pool(http, (used + free) * args.block_size)
            print(f"touched the KV pool: {touched} prompt tokens for {used + free} blocks of {args.block_size}")
        runner = Soak(http, time.monotonic() + args.duration, args.max_requests, args.seed)
        if pid:
            samples.append(MemorySample(0.0, 0, rss_bytes(pid)))
        started = time.monotonic()
        sampler = asyncio.create_task(sample_memory(runner, pid, args.window, samples)) if pid else None
        await asyncio.gather(*(runner.worker(index) for index in range(args.concurrency)))
        elapsed = time.monotonic() - started
        if sampler is not None:
            await sampler
        await asyncio.sleep(1.0)  # let the engine free what the last cancelled streams held
        leftovers = len((await http.get("/v1/sessions")).json()["data"])
        leftovers += len((await http.get("/v1/snapshots")).json()["data"])
        used, free = kv_blocks((await http.get("/metrics")).text)
    tally = runner.tally
    print(f"\nran {elapsed:.0f} s at concurrency {args.concurrency}: {tally.requests} requests")
    print("scenarios completed: " + ", ".join(f"{name} {tally.scenarios[name]}" for name in SCENARIOS))
    print(f"unexpected errors: {sum(tally.errors.values())} {dict(tally.errors) or ''}".rstrip())
    for example in tally.examples:
        print(f"  {example}")
    print(f"sessions and snapshots left behind: {leftovers}")
    print(f"KV blocks at the end: {free} free of {used + free} ({used} used)")
    memory_ok = report_memory(samples, args) if samples else True
    return not tally.errors and leftovers == 0 and used == 0 and memory_ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-requests", type=int, default=200_000, help="stop after this many requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="soak a running server (loopback) instead of starting one")
    parser.add_argument("--pid", type=int, help="the running server's process id, for its resident memory")
    parser.add_argument("--api-key", default=f"soak-{uuid.uuid4().hex}", help="the key to send (and start with)")
    parser.add_argument("--port", type=int, default=8019)
    parser.add_argument("--kv-cache-memory", default="512MiB", help="KV pool of the server it starts")
    parser.add_argument("--block-size", type=int, default=EngineConfig().block_size, help="the server's KV block")
    parser.add_argument("--window", type=float, default=30.0, help="seconds between memory samples (default 30)")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of load not judged (default 60)")
    parser.add_argument("--leak-threshold", type=float, default=2.0, help="MiB per 1,000 requests (default 2)")
    parser.add_argument("--leak-requests", action="store_true", help="start a server that keeps every request")
    args = parser.parse_args()
    args.kv_pool_bytes = parse_size(args.kv_cache_memory)
    print(machine_report())
    print(f"settings: {args.duration:.0f} s, concurrency {args.concurrency}, at most {args.max_requests} requests, "
          f"seed {args.seed}")  # fmt: skip
    if args.url is not None:
        passed = asyncio.run(soak(args.url, args.api_key, args.pid, args))
    else:
        with tempfile.TemporaryDirectory() as state_dir:
            serve = ["--model", "default", "--kv-cache-memory", args.kv_cache_memory, "--state-dir", state_dir]
            serve += ["--api-key", args.api_key, "--no-persist-sessions", "--port", str(args.port)]
            module = "bench.leaking_server" if args.leak_requests else "statelm"
            process, startup = launch([sys.executable, "-m", module, "serve", *serve], args.port)
            leak = " (keeping every request object: a deliberate leak)" if args.leak_requests else ""
            print(f"server: statelm serve {' '.join(serve[:4])} --api-key …{leak} (started in {startup:.1f} s)")
            try:
                passed = asyncio.run(soak(f"http://127.0.0.1:{args.port}", args.api_key, process.pid, args))
            finally:
                process.terminate()
                exit_code = process.wait(120)
            print(f"server exit status after SIGTERM: {exit_code}")
            passed = passed and exit_code == 0
    print("PASS" if passed else "FAIL")
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()
