"""`statelm server start|status|scale|stop`: a detached server with its pid file and log under the state dir, and the
number of replicas of a cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.text import Text

from statelm.cli.client import ClientError, StatelmClient
from statelm.cli.common import ApiKeyOption, JsonOption, UrlOption, connect, console, fail, print_json, reports_errors
from statelm.cli.render import duration
from statelm.cli.server_record import ServerRecord, is_statelm_server, process_command
from statelm.config import ServerConfig

server_app = typer.Typer(
    no_args_is_help=True,
    help="Run a statelm server in the background.\n\nExample: statelm server start --port 8000 --model default",
)

StateDirOption = Annotated[
    Path | None,
    typer.Option(help="Where the pid file, log, sessions and snapshots live (default: the user state dir)."),
]
POLL_S = 0.25


def last_log_line(log_file: Path, offset: int) -> str:
    """The latest line (or progress-bar state) the server wrote since offset."""
    try:
        with log_file.open("rb") as log:
            log.seek(max(offset, log_file.stat().st_size - 4096))
            tail = log.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    pieces = [p.strip() for p in tail.replace("\r", "\n").split("\n") if p.strip()]
    return pieces[-1] if pieces else ""


def log_tail(log_file: Path, offset: int, lines: int = 15) -> str:
    """The last lines the server wrote since offset."""
    with log_file.open("rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace")
    return "\n".join(text.replace("\r", "\n").strip().splitlines()[-lines:])


def healthy(url: str) -> bool:
    """Whether /health answers 200."""
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@server_app.command("start", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def start(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = ServerConfig.host,
    port: Annotated[int, typer.Option(help="TCP port.")] = ServerConfig.port,
    state_dir: StateDirOption = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the server to become healthy.")] = 600,
) -> None:
    """Start `statelm serve` in the background and wait until it answers /health.

    Any other option goes to `statelm serve` (see `statelm serve --help`).

    Example: statelm server start --port 8123 --model default --kv-cache-memory 1GiB
    """
    record = ServerRecord.at(state_dir)
    if pid := record.running_pid():
        console.print(f"statelm server already running at {record.url()} (pid {pid})", highlight=False)
        return
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    if healthy(url):
        raise fail(f"something already answers at {url}; choose another --port")
    argv = [sys.executable, "-m", "statelm", "serve", "--host", host, "--port", str(port)]
    argv += ["--state-dir", str(record.state_dir), *ctx.args]
    record.state_dir.mkdir(parents=True, exist_ok=True)
    with record.log_file.open("ab") as log:
        log.write(f"\n==> {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
        offset = log.tell()
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    record.write(process.pid, url)
    started = time.monotonic()
    with console.status("starting") as status:
        while not healthy(url):
            if process.poll() is not None:
                record.clear()
                typer.echo(log_tail(record.log_file, offset), err=True)
                raise fail(f"the server exited with code {process.returncode} while starting (log: {record.log_file})")
            if time.monotonic() - started > timeout:
                raise fail(f"no answer from {url}/health after {timeout:.0f}s; see {record.log_file}")
            line = last_log_line(record.log_file, offset)
            status.update(Text(f"starting statelm server · {time.monotonic() - started:.0f}s · {line[-100:]}"))
            time.sleep(POLL_S)
    console.print(
        f"statelm server running at [bold]{url}[/bold] (pid {process.pid}, ready in "
        f"{time.monotonic() - started:.1f}s; log: {record.log_file})",
        highlight=False,
    )


@server_app.command("status")
def status(state_dir: StateDirOption = None, as_json: JsonOption = False, api_key: ApiKeyOption = None) -> None:
    """Show whether the background server runs, its model and its sessions; exit code 1 if it does not run.

    Example: statelm server status
    """
    record = ServerRecord.at(state_dir)
    pid, url = record.running_pid(), record.url()
    if not pid or not url:
        if as_json:
            print_json({"running": False})
        raise fail(f"no statelm server started by `statelm server start` is running (state dir: {record.state_dir})")
    client = StatelmClient(url, api_key)
    uptime = time.time() - record.pid_file.stat().st_mtime
    info: dict[str, object] = {"running": True, "pid": pid, "url": url, "uptime_s": round(uptime)}
    info["log"] = str(record.log_file)
    try:
        model = client.model()
        info.update(model=model["id"], max_model_len=model.get("max_model_len"))
        info["sessions"] = len(client.sessions())
        info["replicas"] = cluster_replicas(client)
    except ClientError as exc:
        info["error"] = str(exc)
    if as_json:
        print_json(info)
        return
    console.print(f"statelm server running at [bold]{url}[/bold] · pid {pid} · up {duration(uptime)}")
    if "model" in info:
        console.print(f"model {info['model']} (context {info['max_model_len']}) · {info['sessions']} sessions")
        for replica in info["replicas"] or []:
            console.print(
                f"  {replica['name']}: {replica['state']} · pid {replica['pid']} · {replica['sessions']} sessions"
                f" · {replica['in_flight']} requests in flight ({replica['running']} running, {replica['waiting']}"
                " waiting)",
                highlight=False,
            )
    else:
        console.print(f"[yellow]not answering:[/yellow] {info['error']}", highlight=False)
    console.print(f"log {record.log_file}", highlight=False)


def cluster_replicas(client: StatelmClient) -> list[dict[str, object]] | None:
    """The replicas of a server started with --replicas (their state, sessions and load); None for one process."""
    try:
        return client.request("GET", "/v1/cluster")["replicas"]
    except ClientError as exc:
        if exc.status == 404:
            return None
        raise


@server_app.command("scale")
@reports_errors
def scale(
    replicas: Annotated[int, typer.Argument(min=1, help="How many replicas the cluster should have.")],
    wait: Annotated[float, typer.Option(help="Seconds to wait for new replicas to be live (0: do not wait).")] = 600,
    url: UrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Change the number of replicas of a server started with --replicas (an admin key when keys are set).

    Replicas removed first finish their requests and save their sessions, which the others take over.

    Example: statelm server scale 4 --api-key "$ADMIN_KEY"
    """
    client = connect(url, api_key)
    with console.status(f"scaling to {replicas} replicas (removed ones drain first)"):
        result = client.request("POST", "/v1/cluster/scale", {"replicas": replicas})
        deadline = time.monotonic() + wait
        while wait and any(row["state"] == "starting" for row in result["replicas"]):
            if time.monotonic() > deadline:
                raise fail(f"replicas still starting after {wait:.0f}s; see `statelm server status`")
            time.sleep(1)
            result = {**result, "replicas": client.request("GET", "/v1/cluster")["replicas"]}
    added, removed = ", ".join(result["added"]) or "none", ", ".join(result["removed"]) or "none"
    console.print(f"{len(result['replicas'])} replicas · added {added} · removed {removed}", highlight=False)
    for row in result["replicas"]:
        console.print(f"  {row['name']}: {row['state']} · {row['sessions']} sessions", highlight=False)


@server_app.command("stop")
def stop(
    state_dir: StateDirOption = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for it to save sessions and exit.")] = 120,
) -> None:
    """Stop the background server with SIGTERM and wait while it saves its sessions.

    Example: statelm server stop
    """
    record = ServerRecord.at(state_dir)
    pid = record.pid()
    if pid is None:
        raise fail(f"no statelm server started by `statelm server start` is recorded in {record.state_dir}")
    command = process_command(pid)
    if command is None:
        record.clear()
        raise fail(f"the server (pid {pid}) is not running; removed its stale pid file")
    if not is_statelm_server(command):
        record.clear()
        raise fail(f"pid {pid} runs {command[:80]!r}, not a statelm server; not signalling it (removed the pid file)")
    os.kill(pid, signal.SIGTERM)
    started = time.monotonic()
    with console.status(f"stopping statelm server (pid {pid}), saving sessions"):
        while process_command(pid) is not None:
            if time.monotonic() - started > timeout:
                raise fail(f"pid {pid} still runs {timeout:.0f}s after SIGTERM; see {record.log_file}")
            time.sleep(POLL_S)
    record.clear()
    console.print(f"statelm server stopped (pid {pid}, {time.monotonic() - started:.1f}s)")
