"""`statelm server start|status|stop` with a real detached server, and the refusal to signal a foreign pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cli.helpers import run_cli
from tests.e2e.conftest import free_port


def home(tmp_path: Path) -> dict[str, str]:
    """This environment with the state dir under tmp_path and no server chosen by STATELM_URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATELM_")}
    return {**env, "XDG_STATE_HOME": str(tmp_path)}


def start(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`statelm server start ARGS` as a separate process, so that the server does not become our child."""
    command = [sys.executable, "-m", "statelm", "server", "start", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_start_status_chat_stop(tmp_path: Path) -> None:
    env = home(tmp_path)
    state = tmp_path / "statelm"  # the default state dir under this XDG_STATE_HOME
    port = free_port()
    started = start(["--port", str(port), "--model", "default", "--kv-cache-memory", "512MiB"], env)
    assert started.returncode == 0, started.stdout + started.stderr
    assert f"running at http://127.0.0.1:{port}" in started.stdout
    assert (state / "server.pid").exists() and (state / "server.log").exists()
    try:
        status = run_cli(["server", "status", "--json"], env)
        assert status.exit_code == 0, status.output
        info = json.loads(status.stdout)
        assert info["running"] and info["url"] == f"http://127.0.0.1:{port}" and info["sessions"] == 0
        # without --url or STATELM_URL, client commands find the started server
        answer = run_cli(["chat", "-p", "What is the capital of France?", "--temperature", "0"], env)
        assert answer.exit_code == 0 and "Paris" in answer.stdout, answer.output
        again = start(["--port", str(port)], env)
        assert again.returncode == 0 and "already running" in again.stdout
        run_cli(["session", "new", "kept"], env)
        run_cli(["chat", "-s", "kept", "-p", "Hello", "--max-tokens", "4"], env)
    finally:
        stopped = run_cli(["server", "stop"], env)
    assert stopped.exit_code == 0 and "stopped" in stopped.stdout, stopped.output
    assert not (state / "server.pid").exists()
    assert (state / "sessions" / "kept").is_dir()  # stop waited for the server to save its sessions
    status = run_cli(["server", "status"], env)
    assert status.exit_code == 1 and "no statelm server" in status.stderr


def test_start_that_fails_shows_the_log(tmp_path: Path) -> None:
    env = home(tmp_path)
    failed = start(["--port", str(free_port()), "--model", str(tmp_path / "missing.gguf")], env)
    assert failed.returncode == 1
    assert "exited with code 2 while starting" in failed.stderr and "missing.gguf" in failed.stderr
    assert not (tmp_path / "statelm" / "server.pid").exists()


def test_stop_refuses_a_pid_that_is_not_a_statelm_server(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        (state / "server.pid").write_text(f"{stranger.pid}\n")
        refused = run_cli(["server", "stop", "--state-dir", str(state)], {})
        assert refused.exit_code == 1 and "not a statelm server; not signalling it" in refused.stderr
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()
    (state / "server.pid").write_text(f"{stranger.pid}\n")
    stale = run_cli(["server", "stop", "--state-dir", str(state)], {})
    assert stale.exit_code == 1 and "is not running" in stale.stderr
    assert not (state / "server.pid").exists()
