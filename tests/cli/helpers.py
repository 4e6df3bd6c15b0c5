"""Running the CLI in tests: in-process with typer's runner, or in a real terminal under tmux."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner, Result

from statelm.cli.main import app

_terminals = itertools.count()


def run_cli(args: list[str], env: dict[str, str], stdin: str | None = None) -> Result:
    """Run `statelm ARGS` in-process with typer's test runner."""
    return CliRunner().invoke(app, args, input=stdin, env=env)


def has_tmux() -> bool:
    """Whether tmux is installed."""
    return shutil.which("tmux") is not None


class Terminal:
    """`statelm ARGS` in a 120x40 terminal of a private tmux server; the pane stays after it exits."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self.socket = f"statelm-test-{os.getpid()}-{next(_terminals)}"
        command = shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-m", "statelm", *args])
        self._tmux(
            "new-session", "-d", "-x", "120", "-y", "40", "-c", str(cwd or Path.cwd()),
            f"{command}; echo \"[exited $?]\"; sleep 600",
        )  # fmt: skip

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True).stdout

    def send(self, text: str) -> None:
        """Type a line and press Enter."""
        self._tmux("send-keys", "-l", text)
        self._tmux("send-keys", "Enter")

    def keys(self, *keys: str) -> None:
        """Press keys such as `C-c` or `C-d`."""
        self._tmux("send-keys", *keys)

    def screen(self) -> str:
        """The pane's text with its scrollback, wrapped lines joined."""
        return self._tmux("capture-pane", "-p", "-J", "-S", "-1000")

    def wait_for(self, pattern: str, timeout: float = 60, after: int = 0) -> re.Match[str]:
        """Wait until the screen, from character `after` on, matches pattern."""
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            match = re.compile(pattern).search(screen, after)
            if match:
                return match
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} did not appear in {timeout}s; the screen:\n{screen}")
            time.sleep(0.2)

    def close(self) -> None:
        """Kill the tmux server and what runs in it."""
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)
