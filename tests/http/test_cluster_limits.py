"""Per-key limits over two in-process servers that share a state dir and a KeyLedger (as a cluster's replicas do
through Ray), on the tiny model: sessions, stored responses and the journal share of the snapshot quota are counted
over both."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from anyio.from_thread import start_blocking_portal
from fastapi import FastAPI

from statelm.server import launch
from tests.http.conftest import InProcessServer, InProcessTransport, lifespan, serve_configs, tiny_args
from tests.ray_fakes import Remote

pytest.importorskip("ray")

from statelm.cluster.ledger import KeyLedger, LedgerTally

SNAPSHOT_QUOTA = 24 * 1024  # a session of about 30 tokens takes about 17 KB (512 bytes of float32 KV a token)


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessServer, ...]]:
    """Two servers as replicas: one state dir, one ledger, each holding only the sessions it made."""
    state = tmp_path_factory.mktemp("pair") / "state"
    args = ["--dtype", "float32", "--kv-cache-dtype", "float32", "--max-sessions-per-key", "3"]
    args += ["--max-stored-responses", "2", "--snapshot-quota", str(SNAPSHOT_QUOTA)]
    engine_config, server_config = serve_configs(tiny_args(tiny_model, state, *args))
    server_config = replace(server_config, resume_sessions=False)
    ledger, apps = Remote(KeyLedger()), list[FastAPI]()

    async def drop_everywhere(response_ids: list[str]) -> None:
        for app in apps:
            await app.state.responses.drop_stored(response_ids)

    threads = torch.get_num_threads()
    try:
        for _ in range(2):
            tally = LedgerTally(ledger, server_config.max_stored_responses, drop_everywhere)
            apps.append(launch.build_app(engine_config, server_config, tally)[0])
        with ExitStack() as stack:
            portal = stack.enter_context(start_blocking_portal())
            for app in apps:
                stack.enter_context(portal.wrap_async_context_manager(lifespan(app)))
            yield tuple(InProcessServer(app, InProcessTransport(app, portal)) for app in apps)
    finally:
        torch.set_num_threads(threads)


def clients(pair: tuple[InProcessServer, ...]) -> tuple[httpx.Client, ...]:
    return tuple(server.http() for server in pair)


def respond(api: httpx.Client, text: str) -> str:
    body = {"model": "default", "temperature": 0, "max_output_tokens": 4, "input": text}
    response = api.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


def eventually(check: Callable[[], bool]) -> bool:
    """Whether check() holds within ten seconds (the retention acts in the background; a loaded machine is slow)."""
    deadline = time.monotonic() + 10
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def test_a_key_s_sessions_are_counted_over_both_servers(pair: tuple[InProcessServer, ...]) -> None:
    first, second = clients(pair)
    for api, session_id in [(first, "one"), (first, "two"), (second, "three")]:
        assert api.post("/v1/sessions", json={"session_id": session_id}).status_code == 201
    for api in (first, second):
        assert api.post("/v1/sessions", json={"session_id": "four"}).status_code == 429
    assert first.delete("/v1/sessions/one").status_code == 200
    assert second.post("/v1/sessions", json={"session_id": "four"}).status_code == 201
    for api, session_id in [(first, "two"), (second, "three"), (second, "four")]:
        assert api.delete(f"/v1/sessions/{session_id}").status_code == 200


def test_a_restarted_ledger_counts_again_what_the_servers_hold(pair: tuple[InProcessServer, ...]) -> None:
    first, second = clients(pair)
    for api, session_id in [(first, "kept-1"), (second, "kept-2")]:
        assert api.post("/v1/sessions", json={"session_id": session_id}).status_code == 201
    stored = respond(second, "Counted.")  # its chain is the key's third session
    ledger = KeyLedger()
    pair[0].app.state.sessions.manager.tally.ledger.target = ledger  # Ray's restart: empty

    async def recount(app: FastAPI) -> None:  # what EngineReplica.recount does
        app.state.sessions.manager.recount()
        app.state.responses.chains.recount()

    for server in pair:
        server.transport.portal.call(recount, server.app)
    assert first.post("/v1/sessions", json={"session_id": "one-too-many"}).status_code == 429
    (owner,) = {session.owner for session in pair[0].app.state.sessions.manager.sessions.values()}
    assert ledger.add_response(owner, "probe", "probe-chain", time.time(), 1) == [stored]  # counted again
    ledger.forget_responses(["probe"])
    for api, session_id in [(first, "kept-1"), (second, "kept-2")]:
        assert api.delete(f"/v1/sessions/{session_id}").status_code == 200
    assert second.delete(f"/v1/responses/{stored}").status_code == 200


def test_the_stored_response_retention_drops_the_oldest_on_either_server(pair: tuple[InProcessServer, ...]) -> None:
    first, second = clients(pair)
    oldest, other = respond(first, "First."), respond(second, "Second.")
    newest = respond(first, "Third.")
    assert eventually(lambda: first.get(f"/v1/responses/{oldest}").status_code == 404)
    assert second.get(f"/v1/responses/{other}").status_code == 200
    assert first.get(f"/v1/responses/{newest}").status_code == 200
    newest_elsewhere = respond(first, "Fourth.")
    assert eventually(lambda: second.get(f"/v1/responses/{other}").status_code == 404)  # the other server's
    for response_id in (newest, newest_elsewhere):
        assert first.delete(f"/v1/responses/{response_id}").status_code == 200


def test_journals_on_the_other_server_count_toward_the_snapshot_quota(pair: tuple[InProcessServer, ...]) -> None:
    first, second = clients(pair)
    assert first.post("/v1/sessions", json={"session_id": "snap"}).status_code == 201
    turn = {"model": "default", "session_id": "snap", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    assert first.post("/v1/chat/completions", json=turn).status_code == 200
    system = "A long system prompt. " * 600  # a journal of about 13 KB on the second server
    assert second.post("/v1/sessions", json={"session_id": "long", "system": system}).status_code == 201
    journal = pair[1].app.state.sessions.manager.journal
    assert eventually(lambda: journal.stored_bytes(["long"]) > len(system))
    assert first.post("/v1/sessions/snap/snapshot", json={}).status_code == 507
    assert second.delete("/v1/sessions/long").status_code == 200
    snapshot = first.post("/v1/sessions/snap/snapshot", json={})
    assert snapshot.status_code == 201, snapshot.text
    assert first.delete(f"/v1/snapshots/{snapshot.json()['id']}").status_code == 200
