"""Schemathesis fuzzes every route from the server's own OpenAPI schema: no 5xx, every response as documented.

Positive and negative cases from the examples, coverage and fuzzing phases, with a fixed seed and a bounded
number of examples per operation. Every check runs except `positive_data_acceptance`: some schema-valid
requests are rightly refused with 400 for reasons a schema cannot state (a rollback past the end of the
transcript, `stream_options` without `stream`, a prompt longer than the context).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.conftest import start_server, stop_server

KEY = "fuzz-key-0123456789"
ROOT = Path(__file__).resolve().parents[2]
SERVE_ARGS = ["--model", "default", "--kv-cache-memory", "512MiB", "--max-model-len", "128"]
SERVE_ARGS += ["--max-completion-tokens", "16", "--api-key", KEY]
RUN_ARGS = ["--max-examples", "10", "--seed", "20261122", "--phases", "examples,coverage,fuzzing", "--workers", "1"]
RUN_ARGS += ["--checks", "all", "--exclude-checks", "positive_data_acceptance", "--max-response-time", "120"]
RUN_ARGS += ["--request-timeout", "120", "--no-shrink", "--header", f"Authorization: Bearer {KEY}"]


def test_fuzzing_finds_no_server_error_and_no_response_off_the_schema(tmp_path: Path) -> None:
    process, url = start_server(SERVE_ARGS, tmp_path / "server.log")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", *RUN_ARGS],
            cwd=tmp_path,
            env={**os.environ, "SCHEMATHESIS_HOOKS": "tests.e2e.schemathesis_hooks", "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=480,
        )
    finally:
        stop_server(process)
    assert result.returncode == 0, result.stdout[-12000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
