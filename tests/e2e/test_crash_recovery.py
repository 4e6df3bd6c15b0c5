"""Sessions survive SIGKILL: a real server on a tiny model is killed at random (seeded) moments while worker
threads take turns, roll back, fork, snapshot, create and delete sessions, and store and delete responses (each
worker grows a response chain), over several rounds on one state dir.

The test keeps a ledger of what the server answered. After each restart every session holds exactly its
answered changes (a change whose answer the kill cut off may or may not be there, whole), no other session
exists, a turn at temperature 0 gives the stateless reply to the same history, every snapshot is whole, every
stored response answered is there as it was answered (a deleted one is gone) and its chain goes on.
The KV pool is small, so sessions spill (and their journals are compacted) while this goes on.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import start_server, stop_server
from tests.http.conftest import CONTEXT, tiny_args
from tests.models.tiny_model_dir import make_tiny_model_dir

SEED = 19
ROUNDS = 4
WORKERS = 3
TURN_TOKENS = 6
MAX_MESSAGES = 13  # a longer session is rolled back instead of growing: every one fits the small pool
POOL_BYTES = 64 * 4096  # 64 blocks of the tiny model's KV (2 layers, K and V, 16 tokens, 2 heads of 16, 16-bit)
MAX_OWN = 4  # sessions a worker holds at most (forks and creations beyond are turns instead)
SYSTEM = {"role": "system", "content": "Answer briefly."}
KINDS, WEIGHTS = ("turn", "rollback", "fork", "snapshot", "delete", "create"), (52, 8, 12, 13, 8, 7)
RESPONSE_SHARE, UNRESPOND_SHARE = 0.15, 0.25  # steps that are responses; of those, deletions of one
CHAIN_LENGTH = 4  # responses a chain grows to before a worker starts another (each fits the small pool)

Messages = list[dict[str, Any]]


@dataclass
class Change:
    """A change sent to the server whose answer has not come back (yet)."""

    kind: str
    session_id: str
    before: Messages
    message: dict[str, Any] | None = None  # a turn's user message
    stream: bool = False  # whether the turn streams
    keep: int = 0  # a rollback's
    other: str | None = None  # a fork's child


@dataclass
class Ledger:
    """What the server answered: each session's transcript, snapshots with theirs, and changes in flight."""

    transcripts: dict[str, Messages] = field(default_factory=dict)
    snapshots: dict[str, Messages] = field(default_factory=dict)
    loaded: set[str] = field(default_factory=set)  # snapshots loaded and checked
    in_flight: dict[int, Change] = field(default_factory=dict)  # by worker
    failures: list[str] = field(default_factory=list)
    responses: dict[str, dict[str, Any]] = field(default_factory=dict)  # stored responses as answered, by id
    deleted: set[str] = field(default_factory=set)  # responses whose deletion was answered
    chains: dict[int, list[str]] = field(default_factory=dict)  # each worker's chain: its stored responses' ids


def chat_turn(http: httpx.Client, session_id: str, message: dict[str, Any], stream: bool) -> dict[str, Any]:
    """A greedy session turn; the reply as the transcript stores it."""
    body = {"model": "default", "messages": [message], "max_tokens": TURN_TOKENS, "temperature": 0,
            "session_id": session_id, "stream": stream}  # fmt: skip
    if not stream:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]}
    content = ""
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line.removeprefix("data: "))["choices"]
                content += "".join(choice["delta"].get("content") or "" for choice in choices)
    return {"role": "assistant", "content": content}


def stateless(http: httpx.Client, messages: Messages) -> str:
    """The greedy reply to a whole history, without a session."""
    body = {"model": "default", "messages": messages, "max_tokens": TURN_TOKENS, "temperature": 0}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def history(http: httpx.Client, session_id: str) -> Messages | None:
    """A session's transcript; None if it does not exist."""
    response = http.get(f"/v1/sessions/{session_id}/history")
    if response.status_code == 404:
        return None
    assert response.status_code == 200, response.text
    return response.json()["messages"]


def expect(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()


class Worker:
    """Changes its own sessions at random until the server dies, noting in the ledger what was answered."""

    def __init__(self, index: int, url: str, ledger: Ledger, own: list[str], rng: random.Random, tag: str) -> None:
        self.index, self.url, self.ledger, self.own, self.rng, self.tag = index, url, ledger, own, rng, tag
        self.made = 0

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as http:
            try:
                while True:
                    self.step(http)
            except httpx.TransportError:
                return  # the server was killed
            except Exception as exc:  # reported by the test, which runs no assertion in this thread
                self.ledger.failures.append(f"worker {self.index}: {exc!r}")

    def new_id(self) -> str:
        self.made += 1
        return f"{self.tag}w{self.index}n{self.made}"

    def step(self, http: httpx.Client) -> None:
        """One change, picked at random."""
        if self.rng.random() < RESPONSE_SHARE:
            chain = self.ledger.chains.setdefault(self.index, [])
            if chain and self.rng.random() < UNRESPOND_SHARE:
                self.send(http, Change("unrespond", self.rng.choice(chain), []))
            else:
                message = {"role": "user", "content": f"Note {self.rng.randrange(1000)}."}
                self.send(http, Change("respond", "", [], message))
            return
        if not self.own:
            self.send(http, Change("create", self.new_id(), []))
            return
        session_id = self.rng.choice(self.own)
        change = Change(self.pick(session_id), session_id, list(self.ledger.transcripts[session_id]))
        if change.kind == "create":
            change = Change("create", self.new_id(), [])
        elif change.kind == "turn":
            change.message = {"role": "user", "content": f"Tell me about item {self.rng.randrange(1000)}."}
            change.stream = self.rng.random() < 0.5
        elif change.kind == "rollback":
            change.keep = self.rng.randrange(len(change.before) + 1)
        elif change.kind == "fork":
            change.other = self.new_id()
        self.send(http, change)

    def pick(self, session_id: str) -> str:
        """A kind of change: by weight, but a long session is rolled back and the session count kept in bounds."""
        kind = self.rng.choices(KINDS, WEIGHTS)[0]
        if len(self.ledger.transcripts[session_id]) >= MAX_MESSAGES:
            return "rollback"
        grows, shrinks = kind in ("fork", "create"), kind == "delete"
        if (grows and len(self.own) >= MAX_OWN) or (shrinks and len(self.own) <= 2):
            return "turn"
        return kind

    def send(self, http: httpx.Client, change: Change) -> None:
        """Send a change, noted as in flight until its answer is in the ledger."""
        self.ledger.in_flight[self.index] = change
        getattr(self, change.kind)(http, change)
        del self.ledger.in_flight[self.index]

    def create(self, http: httpx.Client, change: Change) -> None:
        expect(http.post("/v1/sessions", json={"session_id": change.session_id, "system": SYSTEM["content"]}), 201)
        self.ledger.transcripts[change.session_id] = [SYSTEM]
        self.own.append(change.session_id)

    def turn(self, http: httpx.Client, change: Change) -> None:
        assert change.message is not None
        reply = chat_turn(http, change.session_id, change.message, change.stream)
        self.ledger.transcripts[change.session_id] = [*change.before, change.message, reply]

    def rollback(self, http: httpx.Client, change: Change) -> None:
        expect(http.post(f"/v1/sessions/{change.session_id}/rollback", json={"keep_messages": change.keep}), 200)
        self.ledger.transcripts[change.session_id] = change.before[: change.keep]

    def fork(self, http: httpx.Client, change: Change) -> None:
        expect(http.post(f"/v1/sessions/{change.session_id}/fork", json={"session_id": change.other}), 201)
        assert change.other is not None
        self.ledger.transcripts[change.other] = list(change.before)
        self.own.append(change.other)

    def snapshot(self, http: httpx.Client, change: Change) -> None:
        snapshot = expect(http.post(f"/v1/sessions/{change.session_id}/snapshot", json={}), 201)
        self.ledger.snapshots[snapshot["id"]] = change.before

    def delete(self, http: httpx.Client, change: Change) -> None:
        expect(http.delete(f"/v1/sessions/{change.session_id}"), 200)
        del self.ledger.transcripts[change.session_id]
        self.own.remove(change.session_id)

    def respond(self, http: httpx.Client, change: Change) -> None:
        assert change.message is not None
        chain = self.ledger.chains.setdefault(self.index, [])
        if len(chain) >= CHAIN_LENGTH:
            chain.clear()
        respond(http, self.ledger, chain, change.message["content"])

    def unrespond(self, http: httpx.Client, change: Change) -> None:
        expect(http.delete(f"/v1/responses/{change.session_id}"), 200)
        forget_response(self.ledger, change.session_id)


def respond(http: httpx.Client, ledger: Ledger, chain: list[str], text: str) -> None:
    """Store a response continuing a chain (starting one if it is empty), noted in the ledger and the chain."""
    body = {"model": "default", "input": text, "max_output_tokens": TURN_TOKENS, "temperature": 0,
            "previous_response_id": chain[-1] if chain else None}  # fmt: skip
    response = expect(http.post("/v1/responses", json=body), 200)
    ledger.responses[response["id"]] = response
    chain.append(response["id"])


def forget_response(ledger: Ledger, response_id: str) -> None:
    """A response deleted: gone from the ledger and its chain."""
    del ledger.responses[response_id]
    ledger.deleted.add(response_id)
    for chain in ledger.chains.values():
        if response_id in chain:
            chain.remove(response_id)


def settle(http: httpx.Client, ledger: Ledger, change: Change) -> None:
    """Take into the ledger what became of a change the kill cut off: it happened whole or not at all."""
    transcripts = ledger.transcripts
    if change.kind == "respond":
        return  # its id never came back: nothing known to check (the chain it continued is checked)
    if change.kind == "unrespond":
        response = http.get(f"/v1/responses/{change.session_id}")
        assert response.status_code == 404 or response.json() == ledger.responses[change.session_id], response.text
        if response.status_code == 404:
            forget_response(ledger, change.session_id)
        return
    found = history(http, change.session_id)
    if change.kind == "turn":
        assert found is not None and found[: len(change.before)] == change.before, (change, found)
        if found != change.before:
            assert found[len(change.before) : -1] == [change.message] and found[-1]["role"] == "assistant", found
        transcripts[change.session_id] = found
    elif change.kind == "rollback":
        assert found in (change.before, change.before[: change.keep]), (change, found)
        transcripts[change.session_id] = found
    elif change.kind == "fork":
        child = history(http, change.other or "")
        assert child in (None, change.before), (change, child)
        if child is not None:
            transcripts[change.other or ""] = child
    elif change.kind == "create":
        assert found in (None, [SYSTEM]), (change, found)
        if found is not None:
            transcripts[change.session_id] = found
    elif change.kind == "delete":
        assert found in (None, change.before), (change, found)
        if found is None:
            del transcripts[change.session_id]


def check_recovered(http: httpx.Client, ledger: Ledger, state: Path) -> None:
    """Every session exactly as answered, every snapshot whole, turns equal to stateless requests."""
    for change in ledger.in_flight.values():
        settle(http, ledger, change)
    ledger.in_flight.clear()
    listed = {session["id"] for session in expect(http.get("/v1/sessions"), 200)["data"]}
    assert listed == set(ledger.transcripts)
    for session_id, transcript in ledger.transcripts.items():
        assert history(http, session_id) == transcript, session_id
    snapshots = expect(http.get("/v1/snapshots"), 200)["data"]
    assert all(snapshot.get("corrupt") is None for snapshot in snapshots)
    assert set(ledger.snapshots) <= {snapshot["id"] for snapshot in snapshots}
    assert not [entry for entry in (state / "snapshots").iterdir() if entry.name.startswith(".")]
    unchecked = [snapshot_id for snapshot_id in ledger.snapshots if snapshot_id not in ledger.loaded]
    for snapshot_id in unchecked:
        load = {"session_id": "loaded", "overwrite": True}
        expect(http.post(f"/v1/snapshots/{snapshot_id}/load", json=load), 201)
        assert history(http, "loaded") == ledger.snapshots[snapshot_id]
        ledger.loaded.add(snapshot_id)
    if unchecked:
        expect(http.delete("/v1/sessions/loaded"), 200)
    for response_id, response in ledger.responses.items():
        assert expect(http.get(f"/v1/responses/{response_id}"), 200) == response, response_id
    for response_id in ledger.deleted:
        assert http.get(f"/v1/responses/{response_id}").status_code == 404, response_id
    for chain in ledger.chains.values():
        if chain:
            respond(http, ledger, chain, "And then?")  # the chain goes on from its head
    for session_id, transcript in ledger.transcripts.items():
        message = {"role": "user", "content": "And what comes next?"}
        reply = chat_turn(http, session_id, message, stream=False)
        assert reply["content"] == stateless(http, [*transcript, message]), session_id
        ledger.transcripts[session_id] = [*transcript, message, reply]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model: a server starts in seconds and a turn takes milliseconds."""
    return make_tiny_model_dir("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), max_position_embeddings=CONTEXT)


@pytest.mark.timeout(300)
def test_sessions_survive_sigkill_at_random_moments(tiny_model: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    state = tmp_path / "state"
    args = [*tiny_args(tiny_model, state), "--kv-cache-memory", str(POOL_BYTES)]
    ledger = Ledger()
    spilled = 0
    for round_index in range(ROUNDS):
        log = tmp_path / f"round-{round_index}.log"
        process, url = start_server(args, log)
        try:
            with httpx.Client(base_url=url, timeout=60) as http:
                check_recovered(http, ledger, state)
            owned = sorted(ledger.transcripts)
            workers = [
                Worker(index, url, ledger, owned[index::WORKERS], random.Random(rng.random()), f"r{round_index}")
                for index in range(WORKERS)
            ]
            threads = [threading.Thread(target=worker.run) for worker in workers]
            for thread in threads:
                thread.start()
            time.sleep(rng.uniform(0.3, 1.5))
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait()
        for thread in threads:
            thread.join()
        assert not ledger.failures, ledger.failures
        spilled += log.read_text().count("spilled session")
    process, url = start_server(args, tmp_path / "last.log")
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            check_recovered(http, ledger, state)
            recoveries = [line for line in http.get("/metrics").text.splitlines()
                          if line.startswith("statelm_journal_recoveries_total")]  # fmt: skip
            assert recoveries and float(recoveries[0].split()[-1]) > 0
    finally:
        stop_server(process)
    assert spilled > 0  # the kills also fell among spills and journal compactions
    assert list((state / "journal").iterdir()) == []  # a graceful stop leaves every session compacted
