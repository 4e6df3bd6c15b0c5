"""Soak: mixed stateless, session, snapshot and cancelled requests at fixed concurrency, bounded in time and count.

Usage: .venv/bin/python -m bench.soak [--duration 600] [--concurrency 16] [--max-requests 200000]
                                      [--url URL --pid PID --api-key KEY] [--kv-cache-memory 512MiB]

Each worker repeats one of four scenarios, chosen in turn from a seeded generator:
  stateless  a short chat completion;
  session    create a session, two turns, check its history, delete it;
  snapshot   create a session, one turn, snapshot it, load the snapshot as a second session, one turn there,
             delete the snapshot and both sessions;
  cancelled  a long streamed turn (in a session or stateless) closed after three chunks; the session must
             be left as it was, then it is deleted.
A status other than the scenario expects, or any transport error, is an unexpected error (there must be none).
Without --url it starts `statelm serve --model default` on 127.0.0.1 with an API key and a temporary state
dir, and reads its resident memory from /proc (Linux). At the end it reports the errors, the server's
resident memory at the start (after one warm-up request) and at the end against the KV pool's size, and the
KV blocks free (all of them must be: every session was deleted).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import machine_report, start_server
from statelm.config import parse_size

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
        runner = Soak(http, time.monotonic() + args.duration, args.max_requests, args.seed)
        await runner.chat(random.Random(0))  # warm-up: first-use allocations are not growth
        rss_start = rss_bytes(pid) if pid else None
        started = time.monotonic()
        await asyncio.gather(*(runner.worker(index) for index in range(args.concurrency)))
        elapsed = time.monotonic() - started
        await asyncio.sleep(1.0)  # let the engine free what the last cancelled streams held
        rss_end = rss_bytes(pid) if pid else None
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
    rss_ok = True
    if rss_start is not None and rss_end is not None:
        growth = rss_end - rss_start
        rss_ok = growth <= args.kv_pool_bytes
        print(f"server resident memory: {rss_start / 2**20:.0f} MiB at the start, {rss_end / 2**20:.0f} MiB at the end "
              f"({growth / 2**20:+.0f} MiB; KV pool {args.kv_pool_bytes / 2**20:.0f} MiB)")  # fmt: skip
    return not tally.errors and leftovers == 0 and used == 0 and rss_ok


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
            serve += ["--api-key", args.api_key, "--no-persist-sessions"]
            process, startup = start_server(serve, args.port)
            print(f"server: statelm serve {' '.join(serve[:4])} --api-key … (started in {startup:.1f} s)")
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
