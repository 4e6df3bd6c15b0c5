"""SIGTERM to a replica's process starts its drain instead of ending it (statelm.cluster.sigterm), in a child process
that handles SIGTERM the way Ray's worker does."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray")

CHILD = """
import os, signal, time
import ray._private.worker as ray_worker
from statelm.cluster.sigterm import drain_on_sigterm, exit_process

class Worker:  # Ray's worker: the handler defined in main_loop exits through raise_sys_exit_with_custom_error_message
    def main_loop(self):
        def sigterm_handler(signum, frame):
            ray_worker.raise_sys_exit_with_custom_error_message("The process receives a SIGTERM.", exit_code=1)
        signal.signal(signal.SIGTERM, sigterm_handler)

{setup}
drains = []
print("redirected:", drain_on_sigterm(lambda: drains.append(1)), flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("alive after SIGTERM; drains started:", len(drains), flush=True)
{then}
time.sleep(10)
print("still alive", flush=True)
"""


def run_child(setup: str, then: str) -> subprocess.CompletedProcess[str]:
    code = CHILD.format(setup=setup, then=then)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_sigterm_starts_the_drain_and_the_process_lives_until_it_exits_as_ray_would() -> None:
    child = run_child("Worker().main_loop()", "exit_process()")
    assert "redirected: True" in child.stdout
    assert "alive after SIGTERM; drains started: 1" in child.stdout
    assert "still alive" not in child.stdout and child.returncode == 1, child.stderr  # Ray's exit, status 1


def test_a_second_sigterm_ends_the_process_at_once() -> None:
    child = run_child("Worker().main_loop()", "os.kill(os.getpid(), signal.SIGTERM)")
    assert "drains started: 1" in child.stdout
    assert "still alive" not in child.stdout and child.returncode == 1


def test_where_ray_does_not_handle_sigterm_as_expected_nothing_is_redirected() -> None:
    child = run_child("signal.signal(signal.SIGTERM, lambda signum, frame: None)", "raise SystemExit(0)")
    assert "redirected: False" in child.stdout
    assert "drains started: 0" in child.stdout
