"""Session journal (`--session-durability turn`): per-turn cost, turn latency and decode against `spill`, recovery.

Usage: .venv/bin/python -m bench.journal [--records 300] [--turns 60] [--reps 5] [--sessions 100] [--dir /tmp]

(a) Journal writes alone, through the server's SessionJournal, in a temporary directory under --dir (its
    file system is printed): a turn record (a 200-character question and a 400-character reply) appended
    and fsynced, timed from the event loop's request to its `settled` (what a turn's answer waits for),
    one at a time; the bare write + fsync of the same bytes (the storage's floor); and 64 sessions'
    records asked for at once (turns of a batch ending together), until the last is durable, with one
    writer thread and with the server's number.
(b) End to end: two `statelm serve --model default` side by side, one with `--session-durability turn`
    and one with `spill` (temporary state dirs), measured one after the other, --reps rounds (so that
    both see the same load from the rest of the machine); --turns greedy session turns of 8 tokens per
    setting, one at a time over 4 sessions: median and p90 latency of the whole request.
(c) Decode throughput under each setting, once per round: 8 sessions each take one 128-token turn
    (ignore_eos) at once; completion tokens per second of wall time.
(d) Recovery: --sessions sessions of 10 turns each written as the server writes them (half also with a
    saved directory as of their 5th turn, so their journal holds the 5 turns after it), then the start-up
    recovery (recover_sessions) timed, files in the page cache.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from bench.common import machine_report, server_for
from statelm.engine.session_kv import SessionKVData
from statelm.models.loader import ModelFingerprint
from statelm.sessions.directory_store import DirectoryStore
from statelm.sessions.journal import encode_record
from statelm.sessions.journal_records import session_record, turn_record
from statelm.sessions.journal_store import WORKERS, SessionJournal
from statelm.sessions.recovery import recover_sessions
from statelm.sessions.session import Session, SessionSettings
from statelm.sessions.snapshot_format import SnapshotContent, write_snapshot
from statelm.sessions.state_store import Area

QUESTION = {"role": "user", "content": "Which of the observatory's storm records mentions the wind first? " * 3}
REPLY = {"role": "assistant", "content": "The entry of the ninth of March, which notes a strong westerly wind. " * 6}
FINGERPRINT = ModelFingerprint({"config": "c", "weights": "w", "dtype": "bfloat16", "tokenizer": "t"})


def percentiles(seconds: list[float]) -> str:
    """Median, p90 and p99 in milliseconds."""
    ordered = sorted(seconds)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000  # noqa: E731
    return f"median {statistics.median(ordered) * 1000:6.2f} ms  p90 {pick(0.9):6.2f} ms  p99 {pick(0.99):6.2f} ms"


def file_system(directory: Path) -> str:
    """The file system type and device of the mount holding directory."""
    best = ("?", "?", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        device, mount, kind = line.split()[:3]
        if str(directory.resolve()).startswith(mount) and len(mount) > len(best[2]):
            best = (kind, device, mount)
    return f"{best[0]} on {best[1]}"


def new_session(session_id: str) -> Session:
    session = Session(session_id, SessionSettings(system="Answer briefly."))
    session.transcript = [{"role": "system", "content": "Answer briefly."}]
    return session


async def journal_writes(directory: Path, records: int) -> None:
    """(a)"""
    store = DirectoryStore(directory)
    store.prepare(Area.JOURNAL, exclusive=True)
    journal = SessionJournal(store, appending=True)
    session = new_session("bench")
    journal.rewrite("bench", session_record(session))
    await journal.settled("bench")
    waits = []
    for lsn in range(2, records + 2):
        session.lsn = lsn
        started = time.perf_counter()
        journal.append("bench", turn_record(session, [QUESTION, REPLY]))
        await journal.settled("bench")
        waits.append(time.perf_counter() - started)
    data = encode_record(turn_record(session, [QUESTION, REPLY]))
    floor = []
    descriptor = os.open(directory / "floor", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for _ in range(records):
        started = time.perf_counter()
        os.write(descriptor, data)
        os.fsync(descriptor)
        floor.append(time.perf_counter() - started)
    os.close(descriptor)
    await journal.close()
    batch = {workers: await all_at_once(directory / f"batch-{workers}", workers) for workers in (1, WORKERS)}
    print(f"\n(a) journal writes in {directory} ({file_system(directory)}), a turn record of {len(data)} bytes")
    print(f"  append + fsync, requested to settled   {percentiles(waits)}   ({records} records)")
    print(f"  bare write + fsync of the same bytes   {percentiles(floor)}")
    for workers, seconds in batch.items():
        print(f"  64 sessions' records at once, {workers} writer threads: all durable after {seconds * 1000:.1f} ms"
              " (median of 5)")  # fmt: skip


async def all_at_once(directory: Path, workers: int) -> float:
    """Seconds until the records of 64 sessions asked for at once are all durable (median of 5)."""
    store = DirectoryStore(directory)
    store.prepare(Area.JOURNAL, exclusive=True)
    journal = SessionJournal(store, appending=True, workers=workers)
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        for index in range(64):
            journal.append(f"batch-{index}", session_record(new_session(f"batch-{index}")))
        await asyncio.gather(*(journal.settled(f"batch-{index}") for index in range(64)))
        timings.append(time.perf_counter() - started)
    await journal.close()
    return statistics.median(timings)


def turn_latency(http: httpx.Client, turns: int, tag: str) -> list[float]:
    """(b) for one server: latency of greedy session turns of 8 tokens, one at a time over 4 sessions."""
    for index in range(4):
        http.post("/v1/sessions", json={"session_id": f"{tag}-{index}", "system": "Answer briefly."})
    latencies = []
    for turn in range(turns + 4):  # the first turn of each session prefills the system prompt: not counted
        session_id = f"{tag}-{turn % 4}"
        if turn >= 4 and turn % 4 == 0:  # keep the sessions short: every turn sees about the same prompt
            for index in range(4):
                http.post(f"/v1/sessions/{tag}-{index}/rollback", json={"keep_messages": 1})
        body = {"model": "default", "messages": [{"role": "user", "content": f"Name a city, number {turn}."}],
                "max_tokens": 8, "temperature": 0, "session_id": session_id}  # fmt: skip
        started = time.perf_counter()
        http.post("/v1/chat/completions", json=body).raise_for_status()
        latencies.append(time.perf_counter() - started)
    return latencies[4:]


def decode_throughput(http: httpx.Client, tag: str) -> float:
    """(c) for one server: completion tokens per second of wall time of 8 concurrent 128-token session turns."""
    ids = [f"{tag}-decode-{index}" for index in range(8)]
    for session_id in ids:
        http.post("/v1/sessions", json={"session_id": session_id})
    tokens: list[int] = []
    threads = [threading.Thread(target=long_turn, args=(http, session_id, tokens)) for session_id in ids]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(tokens) / (time.perf_counter() - started)


def long_turn(http: httpx.Client, session_id: str, tokens: list[int]) -> None:
    """A 128-token session turn; its completion tokens are added to tokens."""
    body = {"model": "default", "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 128, "ignore_eos": True, "session_id": session_id}  # fmt: skip
    tokens.append(http.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"])


def end_to_end(args: argparse.Namespace) -> None:
    """(b) and (c): a server per setting, all started first, then measured in turn, --reps times over."""
    settings = args.settings.split(",")
    latencies: dict[str, list[float]] = {durability: [] for durability in settings}
    throughputs: dict[str, list[float]] = {durability: [] for durability in settings}
    with contextlib.ExitStack() as stack:
        clients = {}
        for offset, durability in enumerate(settings):
            state_dir = stack.enter_context(tempfile.TemporaryDirectory())
            serve_args = f"{args.serve_args} --state-dir {state_dir} --session-durability {durability}"
            target = stack.enter_context(server_for(None, args.port + offset, serve_args))
            clients[durability] = stack.enter_context(httpx.Client(base_url=target.url, timeout=600))
        for rep in range(args.reps):
            for durability, http in clients.items():
                latencies[durability] += turn_latency(http, args.turns // args.reps, f"{durability}-{rep}")
                throughputs[durability].append(decode_throughput(http, f"{durability}-{rep}"))
    print(
        f"\n(b) session turn latency, greedy turns of 8 tokens, one at a time, {args.reps} rounds alternating servers"
    )
    for durability in settings:
        timed = latencies[durability]
        print(f"  --session-durability {durability:5}  {percentiles(timed)}  ({len(timed)} turns)")
    print("\n(c) decode throughput, 8 concurrent 128-token session turns, one run per round")
    for durability in settings:
        runs = throughputs[durability]
        listed = ", ".join(f"{value:.1f}" for value in runs)
        print(
            f"  --session-durability {durability:5}  median {statistics.median(runs):6.1f} tokens/s  (runs: {listed})"
        )


def recovery(directory: Path, sessions: int) -> None:
    """(d)"""
    store = DirectoryStore(directory)
    for area in (Area.SESSIONS, Area.JOURNAL):
        store.prepare(area, exclusive=True)
    layer = lambda: torch.zeros(64, 3, 64, dtype=torch.bfloat16)  # noqa: E731  # the default model's KV shape
    kv = SessionKVData(list(range(64)), [layer() for _ in range(30)], [layer() for _ in range(30)])

    async def write() -> None:
        journal = SessionJournal(store, appending=True)
        lsn = 0
        for index in range(sessions):
            session = new_session(f"session-{index}")
            lsn += 1
            session.lsn = lsn
            journal.rewrite(session.id, session_record(session))
            for turn in range(10):
                lsn += 1
                session.lsn = lsn
                session.transcript += [QUESTION, REPLY]
                journal.append(session.id, turn_record(session, [QUESTION, REPLY]))
                if turn == 4 and index % 2:
                    await journal.settled(session.id)
                    manifest = {"model": {"name": "m", "fingerprint": FINGERPRINT.parts}, "lsn": lsn,
                                **session.manifest_fields()}  # fmt: skip
                    write_snapshot(store, Area.SESSIONS, session.id, manifest, SnapshotContent(session.transcript, kv))
                    journal.compact(session.id)
        await journal.close()

    asyncio.run(write())
    journal_bytes = sum(store.log_size(name) for name in store.log_names())
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        recovered = recover_sessions(store, FINGERPRINT)
        timings.append(time.perf_counter() - started)
    assert len(recovered.sessions) == sessions and all(len(s.transcript) == 21 for s in recovered.sessions)
    alone, kib = sessions - sessions // 2, journal_bytes / 1024
    print(f"\n(d) recovery of {sessions} sessions of 10 turns ({sessions // 2} from a directory plus 5 journalled "
          f"turns, {alone} from the journal alone; {kib:.0f} KiB of journals)")  # fmt: skip
    print(f"  recover_sessions: median {statistics.median(timings) * 1000:.1f} ms of 5, page cache warm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the journal files of (a) and (d) go")
    parser.add_argument("--records", type=int, default=300)
    parser.add_argument("--turns", type=int, default=60, help="turns of (b) per setting, over all rounds")
    parser.add_argument("--reps", type=int, default=5, help="rounds of (b) and (c), the servers alternating")
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--port", type=int, default=8037)
    parser.add_argument("--serve-args", default="--kv-cache-memory 1GiB", help="extra `statelm serve` flags")
    parser.add_argument(
        "--settings", default="turn,spill", help="the --session-durability values of (b) and (c), in order"
    )
    parser.add_argument("--skip-server", action="store_true", help="only (a) and (d): no server is started")
    args = parser.parse_args()
    print(machine_report())
    print(f"settings: {args.records} records, {args.turns} turns, {args.sessions} sessions, "
          f"durability {args.settings}, serve {args.serve_args!r}")  # fmt: skip
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        asyncio.run(journal_writes(Path(directory), args.records))
    if not args.skip_server:
        end_to_end(args)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        recovery(Path(directory), args.sessions)


if __name__ == "__main__":
    main()
