"""The pid file, URL file and log of a server started by `statelm server start`, and checks on its process."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from statelm.paths import default_state_dir


def process_command(pid: int) -> str | None:
    """The command line of a live process, or None when there is no such process (zombies count as gone)."""
    proc = Path(f"/proc/{pid}")
    if Path("/proc/self").exists():
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return None
            return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return None
    found = subprocess.run(["ps", "-o", "stat=,command=", "-p", str(pid)], capture_output=True, text=True)
    stat, _, command = found.stdout.strip().partition(" ")
    return None if found.returncode or stat.startswith("Z") else command.strip()


def is_statelm_server(command: str) -> bool:
    """Whether a command line is a `statelm serve` process."""
    words = command.split()
    return "serve" in words and any("statelm" in word for word in words)


@dataclass
class ServerRecord:
    """Files under the state dir that describe the detached server: pid, URL and log."""

    state_dir: Path

    @classmethod
    def at(cls, state_dir: Path | None) -> ServerRecord:
        """The record under state_dir, or under the default state dir."""
        return cls(state_dir or default_state_dir())

    @property
    def pid_file(self) -> Path:
        """Holds the server's process id."""
        return self.state_dir / "server.pid"

    @property
    def url_file(self) -> Path:
        """Holds the server's base URL."""
        return self.state_dir / "server.url"

    @property
    def log_file(self) -> Path:
        """The server's stdout and stderr, appended to on every start."""
        return self.state_dir / "server.log"

    def write(self, pid: int, url: str) -> None:
        """Record a freshly started server."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for path, text in ((self.url_file, url), (self.pid_file, str(pid))):
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text + "\n")
            tmp.replace(path)

    def pid(self) -> int | None:
        """The recorded pid, if a readable one is recorded."""
        try:
            return int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def url(self) -> str | None:
        """The recorded URL."""
        try:
            return self.url_file.read_text().strip() or None
        except FileNotFoundError:
            return None

    def clear(self) -> None:
        """Forget the recorded server."""
        self.pid_file.unlink(missing_ok=True)
        self.url_file.unlink(missing_ok=True)

    def running_pid(self) -> int | None:
        """The recorded pid if that process is alive and is a statelm server."""
        pid = self.pid()
        command = process_command(pid) if pid else None
        return pid if command and is_statelm_server(command) else None


def recorded_url() -> str | None:
    """The URL of the server `statelm server start` runs in the default state dir, if it is running."""
    record = ServerRecord.at(None)
    return record.url() if record.running_pid() else None
