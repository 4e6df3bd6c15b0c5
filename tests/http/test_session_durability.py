"""--session-durability in-process on the tiny model: what each setting writes, the flags, the metrics.

Crashes themselves (SIGKILL of a real server) are in tests/e2e/test_crash_recovery.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from statelm.cli.main import app as cli
from statelm.config import SessionDurability
from statelm.sessions.journal import read_journal
from tests.http.conftest import InProcessServer, serve_configs, serve_in_process, tiny_args


def session_with_a_turn(http: httpx.Client, session_id: str) -> None:
    assert http.post("/v1/sessions", json={"session_id": session_id, "system": "Be brief."}).status_code == 201
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "session_id": session_id}  # fmt: skip
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def journal_metrics(http: httpx.Client) -> dict[str, float]:
    lines = http.get("/metrics").text.splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("statelm_journal_")}


@pytest.mark.parametrize(
    ("flags", "durability"),
    [
        ([], SessionDurability.TURN),
        (["--session-durability", "spill"], SessionDurability.SPILL),
        (["--session-durability", "off"], SessionDurability.OFF),
        (["--no-persist-sessions"], SessionDurability.OFF),
    ],
)
def test_durability_flags(flags: list[str], durability: SessionDurability) -> None:
    assert serve_configs(flags)[1].session_durability is durability


def test_no_persist_sessions_contradicts_another_durability() -> None:
    result = CliRunner().invoke(cli, ["serve", "--no-persist-sessions", "--session-durability", "turn"])
    assert result.exit_code == 2 and "contradicts" in result.output


def test_turn_durability_journals_every_change_before_answering(server: InProcessServer, state_dir: Path) -> None:
    with server.http() as http:
        before = journal_metrics(http)
        session_with_a_turn(http, "journalled")
        assert http.post("/v1/sessions/journalled/rollback", json={"keep_messages": 1}).status_code == 200
        records = read_journal(state_dir / "journal" / "journalled.journal").records
        assert [record["type"] for record in records] == ["session", "turn", "rollback"]
        assert records[1]["messages"][0] == {"role": "user", "content": "Hi"}
        after = journal_metrics(http)
        assert after["statelm_journal_appends_total"] - before["statelm_journal_appends_total"] == 3
        written = after["statelm_journal_bytes_total"] - before["statelm_journal_bytes_total"]
        assert written == (state_dir / "journal" / "journalled.journal").stat().st_size
        assert http.delete("/v1/sessions/journalled").status_code == 200
        deadline = time.monotonic() + 10  # the journal, then only saying it is deleted, goes after the answer
        while (state_dir / "journal" / "journalled.journal").exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)


@pytest.mark.parametrize("durability", ["spill", "off"])
def test_spill_and_off_write_no_journal(tiny_model: Path, tmp_path: Path, durability: str) -> None:
    state = tmp_path / "state"
    with (
        serve_in_process(tiny_args(tiny_model, state, "--session-durability", durability)) as server,
        server.http() as http,
    ):
        session_with_a_turn(http, "kept")
        assert journal_metrics(http)["statelm_journal_appends_total"] == 0
        assert not list((state / "journal").glob("*")) if durability == "spill" else not (state / "journal").exists()
    assert (state / "sessions" / "kept").is_dir() == (durability == "spill")  # saved at the graceful stop
