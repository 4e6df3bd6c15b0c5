"""--session-durability in-process on the tiny model: what each setting writes, the flags, the metrics, and what a
crash leaves of response chains (the state dir copied while the server runs: its journals, without a graceful save).

Crashes themselves (SIGKILL of a real server) are in tests/e2e/test_crash_recovery.py.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from statelm.cli.main import app as cli
from statelm.config import SessionDurability
from statelm.server.auth import key_digest, owner_of
from statelm.sessions.directory_store import DirectoryStore
from statelm.sessions.journal import decode_journal
from statelm.sessions.journal_records import flatten
from statelm.sessions.session import SessionKind
from tests.http.conftest import InProcessServer, serve_configs, serve_in_process, tiny_args
from tests.http.test_responses import chain_of, chains, create, stream_events


def session_with_a_turn(http: httpx.Client, session_id: str) -> None:
    assert http.post("/v1/sessions", json={"session_id": session_id, "system": "Be brief."}).status_code == 201
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "session_id": session_id}  # fmt: skip
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def journal_records(path: Path) -> list[dict]:
    """The records of a journal file, with those a batch holds in its place."""
    return flatten(decode_journal(path.read_bytes()).records)


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


def test_turn_durability_journals_every_change_before_answering(
    server: InProcessServer, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_appends(monkeypatch)
    with server.http() as http:
        before = journal_metrics(http)
        session_with_a_turn(http, "journalled")
        assert http.post("/v1/sessions/journalled/rollback", json={"keep_messages": 1}).status_code == 200
        records = journal_records(state_dir / "journal" / "journalled.journal")
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


def crashed(state: Path, into: Path) -> Path:
    """What a crash would leave now: the state dir as it is while the server runs, copied before any graceful save.

    A file the server removes while the copy runs (a deleted chain's journal) is left out, as a crash after its
    removal would leave it.
    """
    shutil.copytree(state, into, copy_function=_copy_unless_removed)
    return into


def _copy_unless_removed(source: str, target: str) -> None:
    """Copy one file of the state dir, or nothing if the running server removed it since it was listed."""
    with contextlib.suppress(FileNotFoundError):
        shutil.copy2(source, target)


@pytest.mark.parametrize("durability", ["turn", "spill"])
def test_idle_sessions_are_saved_with_their_kv_and_a_crash_then_keeps_them(
    tiny_model: Path, tmp_path: Path, durability: str
) -> None:
    state = tmp_path / "state"
    flags = ("--session-durability", durability)
    with (
        serve_in_process(tiny_args(tiny_model, state, *flags, "--persist-idle-after", "0.2")) as server,
        server.http() as http,
    ):
        session_with_a_turn(http, "idle")
        deadline = time.monotonic() + 10
        while not (state / "sessions" / "idle").is_dir() or (state / "journal" / "idle.journal").exists():
            assert time.monotonic() < deadline  # saved, and its journal compacted away
            time.sleep(0.05)
        crashed_state = crashed(state, tmp_path / "crashed")
    with serve_in_process(tiny_args(tiny_model, crashed_state, *flags)) as server, server.http() as http:
        session = http.get("/v1/sessions/idle").json()
        assert session["num_messages"] == 3  # system, question, answer: the turn was kept
        assert session["state"] == "spilled" and session["num_tokens"] > 0  # with its KV, not to be recomputed


def chain_state(server: InProcessServer) -> dict[str, tuple[object, ...]]:
    """Each response chain's id: its transcript, stored responses, owner and kind."""
    return {
        chain.id: (chain.transcript, chain.annotations["responses"], chain.owner, chain.kind)
        for chain in chains(server)
    }


def test_stored_responses_and_chain_turns_survive_a_crash(tiny_model: Path, tmp_path: Path) -> None:
    def args(state: Path) -> list[str]:
        return tiny_args(tiny_model, state, "--api-key", "alice", "--api-key", "bob")

    with serve_in_process(args(tmp_path / "state")) as server, server.http("alice") as api:
        first = create(api, {"input": "Remember the number seven."})
        second = create(api, {"input": "What number?", "previous_response_id": first["id"]})  # a turn of the chain
        branch = create(api, {"input": "And eight?", "previous_response_id": first["id"]})  # a new chain
        events = stream_events(api, {"input": "Why?", "previous_response_id": second["id"]})
        streamed = events[-1]["response"]
        assert events[-1]["type"] in ("response.completed", "response.incomplete")  # the response's last event
        unstored = create(api, {"input": "Again?", "previous_response_id": streamed["id"], "store": False})
        assert chain_of(server, streamed["id"]) is chain_of(server, first["id"]) is not chain_of(server, branch["id"])
        before = chain_state(server)
        state = crashed(tmp_path / "state", tmp_path / "crashed")
    assert not list((state / "sessions").iterdir()) and len(list((state / "journal").iterdir())) == 2

    with serve_in_process(args(state)) as server:
        assert chain_state(server) == before
        assert {chain.owner for chain in chains(server)} == {owner_of(key_digest("alice"))}
        with server.http("alice") as api:
            for response in (first, second, branch, streamed):
                assert api.get(f"/v1/responses/{response['id']}").json() == response
            assert api.get(f"/v1/responses/{unstored['id']}").status_code == 404
            metrics = journal_metrics(api)
            assert metrics["statelm_journal_recoveries_total"] == 2
            after = create(api, {"input": "Once more.", "previous_response_id": streamed["id"]})
            assert chain_of(server, after["id"]) is chain_of(server, first["id"])  # the chain goes on
            assert len(chain_of(server, after["id"]).transcript) == len(before[chain_of(server, first["id"]).id][0]) + 2
        with server.http("bob") as api:
            assert api.get(f"/v1/responses/{second['id']}").status_code == 404


def slow_appends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Journal appends that take 50 ms: an answer that did not wait for its records would come before them."""

    append = DirectoryStore.append_log

    def append_slowly(store: DirectoryStore, name: str, data: bytes) -> int:
        time.sleep(0.05)
        return append(store, name, data)

    monkeypatch.setattr(DirectoryStore, "append_log", append_slowly)


def test_deleting_a_response_is_journalled_before_it_is_answered(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    slow_appends(monkeypatch)
    with serve_in_process(tiny_args(tiny_model, state)) as server, server.http() as api:
        first = create(api, {"input": "One."})
        second = create(api, {"input": "Two.", "previous_response_id": first["id"]})
        third = create(api, {"input": "Three.", "previous_response_id": second["id"]})
        chain = chain_of(server, first["id"])
        journal = state / "journal" / f"{chain.id}.journal"
        kept = len(chain.transcript)
        assert [record["type"] for record in decode_journal(journal.read_bytes()).records] == [
            "session", "batch", "batch", "batch"
        ]  # fmt: skip  # each turn with the response it stored, written as one
        assert [record["type"] for record in journal_records(journal)] == [
            "session", "turn", "annotation", "turn", "annotation", "turn", "annotation"
        ]  # fmt: skip
        assert api.delete(f"/v1/responses/{second['id']}").status_code == 200  # from the middle: its record only
        assert api.delete(f"/v1/responses/{third['id']}").status_code == 200  # the latest: the chain is cut back
        records = journal_records(journal)[-3:]
        assert [(record["type"], record.get("key"), record.get("value", 0)) for record in records] == [
            ("annotation", second["id"], None), ("annotation", third["id"], None), ("rollback", None, 0)
        ]  # fmt: skip
        assert records[-1]["keep_messages"] == 2 < kept
        cut_back = crashed(state, tmp_path / "cut-back")
        assert api.delete(f"/v1/responses/{first['id']}").status_code == 200  # the last one: the chain goes
        assert chains(server) == []
        deleted = crashed(state, tmp_path / "deleted")  # its journal says so durably (or is gone already)
        assert not journal.exists() or [record["type"] for record in journal_records(journal)] == ["delete"]

    with serve_in_process(tiny_args(tiny_model, cut_back)) as server, server.http() as api:
        assert api.get(f"/v1/responses/{first['id']}").json() == first
        for response in (second, third):
            assert api.get(f"/v1/responses/{response['id']}").status_code == 404
        (recovered,) = chains(server)
        assert recovered.id == chain.id and recovered.kind is SessionKind.RESPONSES and len(recovered.transcript) == 2
    with serve_in_process(tiny_args(tiny_model, deleted)) as server, server.http() as api:
        assert chains(server) == [] and api.get(f"/v1/responses/{first['id']}").status_code == 404
    assert list((deleted / "journal").iterdir()) == []
