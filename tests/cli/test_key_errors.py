"""A server that wants an API key: the CLI's wrong or missing key is one clear line and exit code 1."""

from __future__ import annotations

from pathlib import Path

from tests.cli.helpers import run_cli
from tests.e2e.conftest import start_server, stop_server


def test_wrong_or_missing_key_is_one_line_and_the_right_one_works(tmp_path: Path) -> None:
    args = ["--model", "default", "--kv-cache-memory", "64MiB", "--state-dir", str(tmp_path / "state")]
    process, url = start_server([*args, "--api-key", "right-key"], tmp_path / "server.log")
    try:
        env = {"STATELM_URL": url, "XDG_STATE_HOME": str(tmp_path / "home")}
        for key in ("wrong-key", None):
            result = run_cli(["session", "ls", *(["--api-key", key] if key else [])], env)
            assert result.exit_code == 1
            lines = result.output.strip().splitlines()
            assert len(lines) == 1 and "key" in lines[0].lower(), result.output
        assert run_cli(["session", "ls", "--api-key", "right-key"], env).exit_code == 0
        assert run_cli(["session", "ls"], {**env, "STATELM_API_KEY": "right-key"}).exit_code == 0
    finally:
        stop_server(process)
