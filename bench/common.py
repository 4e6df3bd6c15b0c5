"""What every benchmark prints first: machine, commit, versions; and a server started for the run."""

from __future__ import annotations

import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

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


def machine_report() -> str:
    """CPU, cores, memory, Python/torch versions and the git commit, one line each."""
    import torch

    cpu, memory = cpu_name(), memory_gib()
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return "\n".join(
        [
            f"machine: {cpu}, {os.cpu_count()} cores, {memory:.0f} GiB, GPU: {gpu}",
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
