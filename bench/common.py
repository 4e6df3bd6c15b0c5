"""What every benchmark prints first: machine, commit, versions; and a server started for the run."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from statelm.engine.engine import Engine
    from statelm.engine.session_kv import SessionKVData

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    """The CPU's model name, from /proc/cpuinfo where there is one."""
    cpu = platform.processor() or "unknown cpu"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    return cpu


def memory_gib() -> float:
    """The machine's physical memory in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def call_times_ms(fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    """Wall times in milliseconds of repeats sequential calls of fn, sorted, after warmup untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return sorted(times)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of fn in milliseconds, after three warm-up calls."""
    return statistics.median(call_times_ms(fn, repeats, warmup=3))


def prefilled_session(engine: Engine, tokens: int, session_id: str = "prefilled") -> SessionKVData:
    """The exact KV of a session of `tokens` tokens, computed as one prompt (a turn of one token, committed)."""
    from statelm.engine.sequence import SamplingParams

    prompt = [(13 * j) % 20000 + 100 for j in range(tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(f"{session_id}-prompt", prompt, params, session_id)
    while engine.has_work():
        engine.step()
    engine.commit_turn(f"{session_id}-prompt", session_id)
    data = engine.sessions.export(session_id)
    assert data is not None and len(data.tokens) == tokens
    return data


def machine_report() -> str:
    """CPU, its vector flags, cores, memory, Python/torch versions and the git commit, one line each."""
    import torch

    from statelm.cpu import describe
    from statelm.kernels.build import target_march

    cpu, memory = cpu_name(), memory_gib()
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return "\n".join(
        [
            f"machine: {cpu}, {os.cpu_count()} cores, {memory:.0f} GiB, GPU: {gpu}",
            f"cpu: {describe()}; statelm kernels -march={target_march()}",
            f"python {platform.python_version()}, torch {torch.__version__}, statelm commit {commit}",
        ]
    )


def start_server(args: list[str], port: int) -> tuple[subprocess.Popen[bytes], float]:
    """Start `statelm serve`; return the process and the seconds until /health answered."""
    return launch([sys.executable, "-m", "statelm", "serve", "--port", str(port), *args], port)


def launch(command: list[str], port: int) -> tuple[subprocess.Popen[bytes], float]:
    """Start any HTTP server command; return the process and the seconds until /health on port answered 200."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise SystemExit(f"port {port} is already in use; pick another")
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        if process.poll() is not None:
            raise SystemExit(f"server exited with code {process.returncode}: {shlex.join(command)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process, time.perf_counter() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.05)


@dataclass
class Target:
    """The server a benchmark measures, and its start-up time when the benchmark started it."""

    url: str
    startup_s: float | None


@contextmanager
def server_for(url: str | None, port: int, serve_args: str) -> Iterator[Target]:
    """The given URL, or a `statelm serve --model default` started (and stopped) for the run."""
    if url is not None:
        yield Target(url, None)
        return
    process, startup = start_server(["--model", "default", *serve_args.split()], port)
    print(f"server: statelm serve --model default {serve_args}".rstrip())
    print(f"start-up (process start to /health OK): {startup:.2f} s")
    try:
        yield Target(f"http://127.0.0.1:{port}", startup)
    finally:
        process.terminate()
        process.wait()


def run_context_benchmark(doc: str, port: int, settings: str, run: Callable[[httpx.Client, int, int], None]) -> None:
    """The command line of a benchmark of a long conversation: `run(http, context_tokens, runs)` against --url, or a
    `statelm serve --model default` started on port with a temporary state dir; settings names the context size."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--url", help="measure a running server instead of starting one")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--context-tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--serve-args", default="--kv-cache-memory 1GiB", help="extra `statelm serve` flags")
    args = parser.parse_args()
    print(machine_report())
    with tempfile.TemporaryDirectory() as state_dir:
        serve_args = f"{args.serve_args} --state-dir {state_dir} --no-persist-sessions"
        with server_for(args.url, args.port, serve_args) as target:
            print(f"settings: {settings} ~{args.context_tokens} tokens, {args.runs} runs per figure, medians")
            with httpx.Client(base_url=target.url, timeout=600) as http:
                run(http, args.context_tokens, args.runs)
