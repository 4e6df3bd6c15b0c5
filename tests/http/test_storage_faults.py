"""A state store that fails under the in-process server (tests/unit/faulty_state_store.py wraps its directory):
every state-changing route refused 507 whole when its record cannot be saved, in its route's error shape; stateless
requests served throughout; /health and /metrics saying what is wrong; the journals a failure broke rewritten once
the store takes writes again, without a restart; spills kept in memory; a vanished state dir made again; a slow disk
never blocking the event loop; what `spill` and `off` promise instead; snapshots removed or damaged underneath.

A real full and read-only file system, and a SIGKILL, are in tests/e2e/test_full_disk.py.
"""

from __future__ import annotations

import errno
import json
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from statelm.api.sessions import session_api_error
from statelm.server import launch
from statelm.server.errors import error_response
from statelm.sessions.journal import decode_journal
from statelm.sessions.storage import StorageCondition, StorageError
from tests.http.conftest import InProcessServer, serve_in_process, tiny_args
from tests.http.test_responses import chain_of, create
from tests.http.test_session_durability import crashed
from tests.unit.faulty_state_store import (
    BUNDLE_WRITES,
    LOG_WRITES,
    WRITES,
    Fault,
    FaultyStore,
    faulty_directory_stores,
)

FULL = Fault(LOG_WRITES | BUNDLE_WRITES, errno.ENOSPC)  # what a full disk fails: removals still work
TURN = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults") / "state"


@pytest.fixture(scope="module")
def faulty(tiny_model: Path, state: Path) -> Iterator[tuple[InProcessServer, FaultyStore]]:
    """The tiny model served on a state store that fails when told to (turn durability)."""
    with serve_faulty(tiny_args(tiny_model, state)) as running:
        yield running


@contextmanager
def serve_faulty(args: list[str]) -> Iterator[tuple[InProcessServer, FaultyStore]]:
    """serve_in_process(args) on a FaultyStore around its state directory: the server and the store."""
    stores: list[FaultyStore] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "DirectoryStore", faulty_directory_stores(stores))
        with serve_in_process(args) as server:
            try:
                yield server, stores[0]
            finally:
                stores[0].clear()  # the graceful stop saves what it can


@pytest.fixture
def clean(faulty: tuple[InProcessServer, FaultyStore]) -> Iterator[tuple[InProcessServer, FaultyStore]]:
    """The faulty server with no fault left behind by the test, and the store taking writes again."""
    yield faulty
    server, store = faulty
    store.clear()
    with server.http() as api:
        wait_for_condition(api, "ok")


def wait_for_condition(api: httpx.Client, condition: str, timeout: float = 10.0) -> dict[str, Any]:
    """/health's state_dir once its condition is condition (the manager looks at the store every second)."""
    deadline = time.monotonic() + timeout
    while True:
        health = api.get("/health")
        assert health.status_code == 200  # liveness is never failed by the state dir
        state_dir = health.json()["state_dir"]
        if state_dir["condition"] == condition:
            return state_dir
        assert time.monotonic() < deadline, state_dir
        time.sleep(0.1)


def refused(response: httpx.Response, what: str, cause: str = "is full") -> None:
    """A 507 in OpenAI's shape, with Retry-After, saying what could not be saved and why."""
    assert response.status_code == 507, response.text
    assert response.headers["retry-after"] == "30"
    error = response.json()["error"]
    assert error["code"] == "insufficient_storage" and error["type"] == "server_error", error
    message = error["message"]
    assert message.startswith(f"could not save {what}") and ": the state directory " in message and cause in message


def storage_refusals(api: httpx.Client) -> dict[str, float]:
    lines = api.get("/metrics").text.splitlines()
    prefix = "statelm_storage_refusals_total{cause="
    return {
        line[len(prefix) + 1 : line.index('"}')]: float(line.split()[-1]) for line in lines if line.startswith(prefix)
    }


def stream_chunks(api: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed chat completion."""
    response = api.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def with_a_turn(api: httpx.Client, session_id: str) -> None:
    """A new session with one turn."""
    assert api.post("/v1/sessions", json={"session_id": session_id}).status_code == 201
    assert api.post("/v1/chat/completions", json={**TURN, "session_id": session_id}).status_code == 200


def session_state(api: httpx.Client, session_id: str) -> tuple[Any, ...]:
    session = api.get(f"/v1/sessions/{session_id}").json()
    return session["num_messages"], session["metadata"], api.get(f"/v1/sessions/{session_id}/history").json()


def test_every_change_that_cannot_be_saved_is_refused_whole_and_stateless_requests_are_served(
    clean: tuple[InProcessServer, FaultyStore], state: Path
) -> None:
    server, store = clean
    with server.http() as api:
        assert api.post("/v1/sessions", json={"session_id": "kept", "metadata": {"k": "v"}}).status_code == 201
        assert api.post("/v1/chat/completions", json={**TURN, "session_id": "kept"}).status_code == 200
        assert api.post("/v1/sessions", json={"session_id": "doomed"}).status_code == 201
        snapshot = api.post("/v1/sessions/kept/snapshot", json={"title": "before"}).json()
        stored = create(api, {"input": "One."})
        chained = create(api, {"input": "Two.", "previous_response_id": stored["id"]})
        before = session_state(api, "kept")
        chain = chain_of(server, stored["id"])
        chain_before = list(chain.transcript)
        refusals = storage_refusals(api).get("full", 0.0)
        store.inject(FULL)

        refused(api.post("/v1/sessions", json={"session_id": "new"}), "the new session 'new'")
        refused(api.post("/v1/chat/completions", json={**TURN, "session_id": "kept"}), "the turn of session 'kept'")
        chunks = stream_chunks(api, {**TURN, "session_id": "kept"})
        assert not any(choice.get("finish_reason") for chunk in chunks for choice in chunk.get("choices", []))
        assert chunks[-1]["error"]["code"] == "insufficient_storage"  # the turn's end never sent
        refused(api.post("/v1/sessions/kept/rollback", json={"keep_messages": 0}), "the rollback of session 'kept'")
        refused(api.post("/v1/sessions/kept/fork", json={"session_id": "child"}), "the new session 'child'")
        refused(api.patch("/v1/sessions/kept", json={"metadata": {"k": "w"}}), "the metadata of session 'kept'")
        refused(api.delete("/v1/sessions/doomed"), "the deletion of session 'doomed'")
        refused(api.post("/v1/sessions/kept/snapshot", json={}), "the snapshot of session 'kept'")
        refused(api.patch(f"/v1/snapshots/{snapshot['id']}", json={"title": "after"}), "the metadata of snapshot")
        refused(api.post(f"/v1/snapshots/{snapshot['id']}/load", json={"session_id": "loaded"}), "the new session")
        refused(api.post(f"/v1/snapshots/{snapshot['id']}/load", json={"session_id": "kept", "overwrite": True}),
                "the new session 'kept'")  # fmt: skip
        body = {"model": "default", "temperature": 0, "max_output_tokens": 4}
        refused(api.post("/v1/responses", json={**body, "input": "New."}), "the new session")
        refused(api.post("/v1/responses", json={**body, "input": "Three.", "previous_response_id": chained["id"]}),
                "the response")  # fmt: skip
        refused(api.delete(f"/v1/responses/{chained['id']}"), f"the deletion of response {chained['id']!r}")

        assert session_state(api, "kept") == before  # every refusal left the session as it was
        assert sorted(s["id"] for s in api.get("/v1/sessions").json()["data"]) == ["doomed", "kept"]
        assert [s["title"] for s in api.get("/v1/snapshots").json()["data"]] == ["before"]
        assert chain.transcript == chain_before and api.get(f"/v1/responses/{chained['id']}").json() == chained
        assert api.post("/v1/chat/completions", json=TURN).status_code == 200  # what keeps nothing is served
        assert (
            api.post("/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 3}).status_code == 200
        )
        messages = {"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
        assert api.post("/v1/messages", json=messages).status_code == 200
        assert api.post("/v1/responses", json={**body, "input": "Hi", "store": False}).status_code == 200
        assert api.delete(f"/v1/snapshots/{snapshot['id']}").status_code == 200  # freeing room works on a full disk
        health = wait_for_condition(api, "full")
        assert health["free_bytes"] == 0 and health["owed_writes"] >= 1 and "location" not in health
        assert storage_refusals(api)["full"] - refusals == 14  # one per refusal above

        store.clear()  # room again: the journals the failures broke are rewritten, without a restart
        assert wait_for_condition(api, "ok")["owed_writes"] == 0
        (record,) = decode_journal((state / "journal" / "kept.journal").read_bytes()).records
        assert record["type"] == "session" and record["transcript"] == before[2]["messages"]
        assert api.post("/v1/sessions", json={"session_id": "new"}).status_code == 201
        assert api.post("/v1/chat/completions", json={**TURN, "session_id": "kept"}).status_code == 200
        for session_id in ("kept", "doomed", "new"):
            assert api.delete(f"/v1/sessions/{session_id}").status_code == 200
        assert api.delete(f"/v1/responses/{chained['id']}").status_code == 200
        assert api.delete(f"/v1/responses/{stored['id']}").status_code == 200


def test_anthropic_routes_answer_a_storage_refusal_in_their_own_shape() -> None:
    error = session_api_error(
        StorageError("could not save the turn: the state directory /s is full", StorageCondition.FULL)
    )
    response = error_response(error, "/v1/messages")
    assert response.status_code == 507 and response.headers["retry-after"] == "30"
    assert json.loads(response.body) == {
        "type": "error",
        "error": {"type": "api_error", "message": "could not save the turn: the state directory /s is full"},
    }


def test_a_change_whose_write_failed_after_taking_effect_is_rewritten_out_of_the_journal(
    clean: tuple[InProcessServer, FaultyStore], state: Path, tmp_path: Path
) -> None:
    """An fsync that fails after the write: the record may be on disk, though the turn was refused; the journal is
    rewritten without it, so that a crash cannot bring it back."""
    server, store = clean
    with server.http() as api:
        assert api.post("/v1/sessions", json={"session_id": "ghost"}).status_code == 201
        store.inject(Fault(LOG_WRITES, errno.EIO, after=True, times=1))
        response = api.post("/v1/chat/completions", json={**TURN, "session_id": "ghost"})
        refused(response, "the turn of session 'ghost'", "failed ([Errno 5] Input/output error)")
        wait_for_condition(api, "ok")
        copy = crashed(state, tmp_path / "crashed")
        assert api.delete("/v1/sessions/ghost").status_code == 200
    records = decode_journal((copy / "journal" / "ghost.journal").read_bytes()).records
    assert [(record["type"], record["transcript"]) for record in records] == [("session", [])]


def test_a_read_only_or_vanished_state_dir_is_reported_refused_and_recovered_from(
    clean: tuple[InProcessServer, FaultyStore], state: Path
) -> None:
    server, store = clean
    with server.http() as api:
        with_a_turn(api, "survivor")
        store.inject(Fault(WRITES, errno.EROFS))
        refused(api.post("/v1/sessions", json={"session_id": "ro"}), "the new session 'ro'", "is read-only")
        refused(api.delete("/v1/sessions/survivor"), "the deletion of session 'survivor'", "is read-only")
        assert wait_for_condition(api, "read-only")["owed_writes"] == 1  # survivor's journal, to rewrite
        store.clear()
        wait_for_condition(api, "ok")

        store.inject(Fault(frozenset({"prepare"}), errno.EACCES))  # it cannot be made again, for now
        shutil.rmtree(state)
        wait_for_condition(api, "missing")
        refused(api.post("/v1/chat/completions", json={**TURN, "session_id": "survivor"}),
                "the turn of session 'survivor'", "no longer exists")  # fmt: skip
        store.clear()  # made again, every session journalled anew
        assert wait_for_condition(api, "ok")["owed_writes"] == 0
        (record,) = decode_journal((state / "journal" / "survivor.journal").read_bytes()).records
        assert len(record["transcript"]) == 2
        assert api.post("/v1/chat/completions", json={**TURN, "session_id": "survivor"}).status_code == 200
        assert api.get("/v1/sessions/survivor/history").json()["messages"][2] == TURN["messages"][0]
        assert api.delete("/v1/sessions/survivor").status_code == 200


def test_a_slow_disk_delays_the_turns_that_wait_on_it_and_nothing_else(
    clean: tuple[InProcessServer, FaultyStore],
) -> None:
    server, store = clean
    with server.http() as api:
        assert api.post("/v1/sessions", json={"session_id": "slow"}).status_code == 201
        store.inject(Fault(LOG_WRITES, error=None, delay_s=2.0))
        answered: list[float] = []

        def slow_turn() -> None:
            started = time.monotonic()
            with server.http() as other:
                assert other.post("/v1/chat/completions", json={**TURN, "session_id": "slow"}).status_code == 200
            answered.append(time.monotonic() - started)

        turn = threading.Thread(target=slow_turn)
        turn.start()
        time.sleep(0.5)  # the turn now waits on its fsync
        started = time.monotonic()
        assert api.get("/health").status_code == 200
        health_s = time.monotonic() - started
        assert api.post("/v1/chat/completions", json=TURN).status_code == 200
        stateless_s = time.monotonic() - started
        turn.join()
        assert health_s < 0.5 and stateless_s < 1.5 and answered[0] >= 2.0, (health_s, stateless_s, answered)
        metrics = {line.split()[0]: float(line.split()[1]) for line in api.get("/metrics").text.splitlines()
                   if line.startswith("statelm_journal_")}  # fmt: skip
        assert metrics["statelm_journal_slow_writes_total"] >= 1 and metrics["statelm_journal_write_seconds_total"] >= 2
        store.clear()
        assert api.delete("/v1/sessions/slow").status_code == 200


def test_snapshots_removed_or_damaged_underneath_are_missing_or_corrupt_and_new_ones_are_written(
    clean: tuple[InProcessServer, FaultyStore], state: Path
) -> None:
    server, _ = clean
    with server.http() as api:
        with_a_turn(api, "snapped")
        first = api.post("/v1/sessions/snapped/snapshot", json={}).json()
        shutil.rmtree(state / "snapshots")
        assert api.get("/v1/snapshots").json()["data"] == []
        assert api.get(f"/v1/snapshots/{first['id']}").status_code == 404
        assert api.post(f"/v1/snapshots/{first['id']}/load", json={}).status_code == 404
        second = api.post("/v1/sessions/snapped/snapshot", json={})
        assert second.status_code == 201
        kv = state / "snapshots" / second.json()["id"] / "kv.safetensors"
        kv.write_bytes(b"\0" * kv.stat().st_size)
        damaged = api.post(f"/v1/snapshots/{second.json()['id']}/load", json={})
        assert damaged.status_code == 422 and damaged.json()["error"]["code"] == "snapshot_corrupt"
        assert api.get("/health").json()["state_dir"]["condition"] == "ok"
        assert api.delete(f"/v1/snapshots/{second.json()['id']}").status_code == 200
        assert api.delete("/v1/sessions/snapped").status_code == 200


def test_a_spill_that_cannot_be_written_keeps_the_session_and_its_kv_in_memory(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A pool of 64 blocks: sessions of a few turns each make it spill; their saved copies cannot be written."""
    args = tiny_args(tiny_model, tmp_path / "state", "--kv-cache-memory", str(64 * 4096))
    with serve_faulty(args) as (server, store), server.http() as api:
        store.inject(Fault(frozenset({"write_bundle"}), errno.ENOSPC))
        for index in range(8):  # prompts of their own (a shared prefix would share its blocks)
            story = [{"role": "user", "content": f"Story {index}. " + "Tell me a story. " * 40}]
            assert api.post("/v1/sessions", json={"session_id": f"s{index}"}).status_code == 201
            body = {**TURN, "messages": story, "max_tokens": 8, "session_id": f"s{index}"}
            assert api.post("/v1/chat/completions", json=body).status_code == 200
        states = {s["id"]: s["state"] for s in api.get("/v1/sessions").json()["data"]}
        spilled = [session_id for session_id, state in states.items() if state == "spilled"]
        assert spilled, states
        health = wait_for_condition(api, "full")
        assert health["owed_writes"] == len(spilled)
        again = {**TURN, "session_id": spilled[0]}
        reply = api.post("/v1/chat/completions", json=again).json()
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its KV came back from memory
        assert len(api.get(f"/v1/sessions/{spilled[0]}/history").json()["messages"]) == 4
        store.clear()
        assert wait_for_condition(api, "ok")["owed_writes"] == 0


@pytest.mark.parametrize("durability", ["spill", "off"])
def test_spill_and_off_promise_nothing_per_change_and_refuse_only_snapshots(
    tiny_model: Path, tmp_path: Path, durability: str
) -> None:
    args = tiny_args(tiny_model, tmp_path / "state", "--session-durability", durability)
    with serve_faulty(args) as (server, store), server.http() as api:
        store.inject(FULL)
        with_a_turn(api, "s")
        assert api.post("/v1/sessions/s/rollback", json={"keep_messages": 0}).status_code == 200
        refused(api.post("/v1/sessions/s/snapshot", json={}), "the snapshot of session 's'")
        assert api.delete("/v1/sessions/s").status_code == 200
        assert wait_for_condition(api, "full")["owed_writes"] == 0


def test_idle_sessions_are_saved_after_the_clock_is_set_back(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    with serve_in_process(tiny_args(tiny_model, state, "--persist-idle-after", "0.3s")) as server, server.http() as api:
        with_a_turn(api, "idle")
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - 86400)  # the wall clock set back a day since the change
        deadline = time.monotonic() + 10
        while not (state / "sessions" / "idle" / "manifest.json").exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
