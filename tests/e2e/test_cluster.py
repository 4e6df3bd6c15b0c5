"""`statelm serve --replicas 2` on a local Ray: affinity, prefix-aware routing, stored completions, per-key limits,
a killed replica, SIGTERM to a replica, drain, scaling, auth.

One cluster of two replicas of the default model serves the whole module (it takes a minute or two to start on two
cores). The router names the replica that answered in `x-statelm-replica`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import free_port, port_was_taken, server_environment

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow

KEY_A, KEY_B, ADMIN = "cluster-key-a", "cluster-key-b", "cluster-admin"
SYSTEM = "Answer in one short sentence."
STARTUP_TIMEOUT_S = 420
REPLICA = "x-statelm-replica"
MAX_SESSIONS = 10  # per key, over both replicas: KEY_A's tests make 9 sessions in all, KEY_B's limit test 10
START_ATTEMPTS = 3  # a start whose router port was taken meanwhile is retried on another


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A router URL in front of two replicas sharing a state dir; stopped (and every Ray process gone) after."""
    root = tmp_path_factory.mktemp("cluster")
    for attempt in range(START_ATTEMPTS):
        process, url, log_path = _start(root, attempt)
        try:
            wait_until(lambda url=url: _healthy(url), STARTUP_TIMEOUT_S, process, log_path)
        except RuntimeError:
            _stop(process)
            # another process (the other pytest worker's server) can take the port picked before the router binds it
            if attempt + 1 < START_ATTEMPTS and port_was_taken(log_path.read_text()):
                continue
            raise
        break
    try:
        yield url
    finally:
        _stop(process)


def _start(root: Path, attempt: int) -> tuple[subprocess.Popen[bytes], str, Path]:
    """`statelm serve --replicas 2` on a free port, its output in root/cluster-<attempt>.log."""
    log_path = root / f"cluster-{attempt}.log"
    port = free_port()
    args = ["--replicas", "2", "--port", str(port), "--kv-cache-memory", "256MiB", "--threads", "1",
            "--state-dir", str(root / "state"), "--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", ADMIN,
            "--drain-timeout", "10", "--max-sessions-per-key", str(MAX_SESSIONS),
            "--max-stored-responses", "2"]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "statelm", "serve", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**server_environment(), "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled"},
            start_new_session=True,  # its own process group: every Ray process it starts can be found after
        )
    return process, f"http://127.0.0.1:{port}", log_path


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the cluster (if still running) and wait for its whole process group to be gone."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    finally:
        with_group_gone(process.pid)


def wait_until(
    ready: Any, timeout: float, process: subprocess.Popen[bytes] | None = None, log: Path | None = None
) -> None:
    """Poll ready() until it is true; fail with the log's tail after timeout or if the process exits."""
    deadline = time.monotonic() + timeout
    while not ready():
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"cluster exited with {process.returncode}:\n{log.read_text()[-4000:] if log else ''}")
        if time.monotonic() > deadline:
            raise TimeoutError(log.read_text()[-4000:] if log else "timed out")
        time.sleep(0.5)


def with_group_gone(group: int) -> None:
    """Wait for the cluster's process group (Ray's processes included) to end; kill what is left, and fail if any."""
    deadline = time.monotonic() + 30
    while (left := _group_members(group)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        os.killpg(group, signal.SIGKILL)
        raise AssertionError(f"processes left after the cluster stopped: {left}")


def _group_members(group: int) -> list[str]:
    found = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(group)], capture_output=True, text=True).stdout
    return [line.strip()[:120] for line in found.splitlines() if line.strip()]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def http(url: str, key: str | None = KEY_A) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=180)


def replicas(url: str) -> dict[str, dict[str, Any]]:
    """The router's view of the replicas, by name."""
    rows = http(url, ADMIN).get("/v1/cluster").json()["replicas"]
    return {row["name"]: row for row in rows}


def turn(client: httpx.Client, session_id: str, question: str) -> httpx.Response:
    body = {"model": "default", "session_id": session_id, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": question}]}  # fmt: skip
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def stateless_reference(client: httpx.Client, session_id: str, question: str) -> str:
    """The reply a stateless request with the session's whole history and the question gives."""
    history = client.get(f"/v1/sessions/{session_id}/history").json()["messages"]
    body = {"model": "default", "temperature": 0, "max_tokens": 24,
            "messages": [*history, {"role": "user", "content": question}]}  # fmt: skip
    return client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]


def assert_adopted_with_its_kv(client: httpx.Client, session_id: str, drained: str) -> None:
    """The session is now on another replica, which took its KV from the store: spilled, its tokens there (a session
    recovered from its journal alone would have none until its next turn)."""
    response = client.get(f"/v1/sessions/{session_id}")
    assert response.headers[REPLICA] != drained
    assert response.json()["state"] == "spilled" and response.json()["num_tokens"] > 0, response.text


def new_session(client: httpx.Client, session_id: str) -> str:
    response = client.post("/v1/sessions", json={"session_id": session_id, "system": SYSTEM})
    assert response.status_code == 201, response.text
    return response.headers[REPLICA]


def test_sessions_are_served_by_their_replica(cluster: str) -> None:
    client = http(cluster)
    placed = {session_id: new_session(client, session_id) for session_id in ["aff-0", "aff-1", "aff-2", "aff-3"]}
    assert set(placed.values()) == {"replica-0", "replica-1"}  # new sessions spread over both
    for session_id, replica in placed.items():
        first = turn(client, session_id, "What is the capital of France?")
        second = turn(client, session_id, "And of Germany?")
        assert first.headers[REPLICA] == second.headers[REPLICA] == replica
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its KV was resident there
        assert client.get(f"/v1/sessions/{session_id}").headers[REPLICA] == replica
    listed = {session["id"] for session in client.get("/v1/sessions").json()["data"]}
    assert set(placed) <= listed  # one list, from both replicas


def test_stateless_requests_sharing_a_prefix_land_on_the_same_replica(cluster: str) -> None:
    client = http(cluster)
    system = "You are the help desk of the Example Corporation. " * 12  # several KV blocks
    answers = []
    for question in ["Where is my order?", "How do I reset my password?", "Can I get a refund?"]:
        body = {"model": "default", "temperature": 0, "max_tokens": 8,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}  # fmt: skip
        answers.append(client.post("/v1/chat/completions", json=body))
    assert len({answer.headers[REPLICA] for answer in answers}) == 1
    assert all(a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 100 for a in answers[1:])


def test_stored_chat_completions_are_found_on_the_replica_that_stored_them(cluster: str) -> None:
    client = http(cluster)
    for question in ["Name a colour.", "Name a fruit.", "Name a river.", "Name a city."]:
        body = {"model": "default", "temperature": 0, "max_tokens": 4, "store": True,
                "messages": [{"role": "user", "content": question}]}  # fmt: skip
        made = client.post("/v1/chat/completions", json=body)
        assert made.status_code == 200, made.text
        stored = client.get(f"/v1/chat/completions/{made.json()['id']}")
        assert stored.status_code == 200 and stored.headers[REPLICA] == made.headers[REPLICA]
        assert http(cluster, KEY_B).get(f"/v1/chat/completions/{made.json()['id']}").status_code == 404


def test_a_key_s_limits_hold_over_both_replicas(cluster: str) -> None:
    client = http(cluster, KEY_B)
    placed = [new_session(client, f"limit-{index}") for index in range(MAX_SESSIONS)]
    assert set(placed) == {"replica-0", "replica-1"}
    assert client.post("/v1/sessions", json={"session_id": "limit-over"}).status_code == 429
    for index in range(MAX_SESSIONS):
        assert client.delete(f"/v1/sessions/limit-{index}").status_code == 200
    body = {"model": "default", "temperature": 0, "max_output_tokens": 2}
    stored = [client.post("/v1/responses", json={**body, "input": text}).json()["id"] for text in ["A.", "B.", "C."]]
    # the oldest of three: dropped in the background, on whichever replica holds it, by a Ray call that may first
    # have to find the other replica (seconds on a loaded machine)
    wait_until(lambda: client.get(f"/v1/responses/{stored[0]}").status_code == 404, 60)
    assert all(client.get(f"/v1/responses/{response_id}").status_code == 200 for response_id in stored[1:])


def test_auth_and_ownership_hold_through_the_router(cluster: str) -> None:
    owner, other = http(cluster, KEY_A), http(cluster, KEY_B)
    new_session(owner, "owned-by-a")
    assert http(cluster, None).get("/v1/sessions").status_code == 401
    assert http(cluster, "wrong").post("/v1/chat/completions", json={}).status_code == 401
    assert other.get("/v1/sessions/owned-by-a").status_code == 404
    assert other.post("/v1/sessions", json={"session_id": "owned-by-a"}).status_code == 409  # same replica's table
    assert "owned-by-a" not in {session["id"] for session in other.get("/v1/sessions").json()["data"]}
    assert "owned-by-a" in {session["id"] for session in http(cluster, ADMIN).get("/v1/sessions").json()["data"]}
    assert owner.post("/v1/cluster/replicas/replica-0/drain").status_code == 403  # admins only
    assert http(cluster, None).get("/v1/cluster").status_code == 401


def signalled_mid_stream(client: httpx.Client, session_id: str, tokens: int, pid: int, signum: int) -> list[str]:
    """The data of the SSE events of a streamed turn of tokens tokens, whose replica (pid) gets signum after three."""
    body = {"model": "default", "session_id": session_id, "temperature": 0, "max_tokens": tokens, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": "Write a very long story."}]}  # fmt: skip
    events = []
    with client.stream("POST", "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    os.kill(pid, signum)
    return events


def test_a_killed_replica_loses_only_its_in_flight_turn(cluster: str) -> None:
    client = http(cluster)
    replica = new_session(client, "killed")
    turn(client, "killed", "What is the capital of France?")
    pid = replicas(cluster)[replica]["pid"]
    events = signalled_mid_stream(client, "killed", 2000, pid, signal.SIGKILL)
    assert '"replica_unavailable"' in events[-1]  # a clean error event ends the stream
    question = "And of Italy?"
    expected = stateless_reference(client, "killed", question)  # the history has the first turn, not the cut one
    answer = turn(client, "killed", question)
    assert answer.headers[REPLICA] != replica  # adopted from the store by the other replica
    assert answer.json()["choices"][0]["message"]["content"] == expected
    wait_until(lambda: replicas(cluster)[replica]["state"] == "live", STARTUP_TIMEOUT_S)  # Ray Serve restarted it


def test_sigterm_to_a_replica_drains_it_and_its_sessions_continue_on_the_other(cluster: str) -> None:
    client = http(cluster)
    wait_until(lambda: all(row["state"] == "live" for row in replicas(cluster).values()), STARTUP_TIMEOUT_S)
    replica = new_session(client, "terminated")
    turn(client, "terminated", "What is the capital of France?")
    pid = replicas(cluster)[replica]["pid"]
    events = signalled_mid_stream(client, "terminated", 48, pid, signal.SIGTERM)
    assert events[-1] == "[DONE]" and not any('"error"' in event for event in events)  # the turn in flight finished
    assert_adopted_with_its_kv(client, "terminated", replica)
    question = "And of Spain?"
    expected = stateless_reference(client, "terminated", question)  # the history has the streamed turn
    answer = turn(client, "terminated", question)
    assert answer.headers[REPLICA] != replica
    assert answer.json()["choices"][0]["message"]["content"] == expected

    def restarted() -> bool:  # the process ended after its drain, and Ray Serve started a new one
        return replicas(cluster)[replica]["state"] == "live" and replicas(cluster)[replica]["pid"] != pid

    wait_until(restarted, STARTUP_TIMEOUT_S)


def test_a_drained_replica_s_sessions_continue_on_the_other(cluster: str) -> None:
    client = http(cluster)
    wait_until(lambda: all(row["state"] == "live" for row in replicas(cluster).values()), STARTUP_TIMEOUT_S)
    replica = new_session(client, "drained")
    turn(client, "drained", "What is the capital of France?")
    drained = http(cluster, ADMIN).post(f"/v1/cluster/replicas/{replica}/drain")
    assert drained.status_code == 200 and drained.json()["sessions"] >= 1
    assert_adopted_with_its_kv(client, "drained", replica)
    question = "And of Spain?"
    expected = stateless_reference(client, "drained", question)
    answer = turn(client, "drained", question)
    assert answer.headers[REPLICA] != replica
    assert answer.json()["choices"][0]["message"]["content"] == expected
    assert replicas(cluster)[replica]["state"] == "drained"


def test_the_cluster_scales_up_and_down_and_a_removed_replica_s_sessions_continue(cluster: str) -> None:
    admin = http(cluster, ADMIN)
    assert http(cluster).post("/v1/cluster/scale", json={"replicas": 2}).status_code == 403
    for body, param in [({"replicas": 0}, "replicas"), ({"replicas": "2"}, "replicas"), ({"replicas": 2, "x": 1}, "x")]:
        refused = admin.post("/v1/cluster/scale", json=body)  # nothing accepted and dropped
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    no_room = admin.post("/v1/cluster/scale", json={"replicas": 1000})  # more than the local Ray instance's CPUs
    assert no_room.status_code == 409 and no_room.json()["error"]["code"] == "no_room", no_room.text
    before = replicas(cluster)
    (drained,) = [name for name, row in before.items() if row["state"] == "drained"]
    command = [sys.executable, "-m", "statelm", "server", "scale", "2", "--url", cluster, "--api-key", ADMIN]
    up = subprocess.run(command, capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S, env=server_environment())
    assert up.returncode == 0, up.stderr  # the drained replica goes, a new one starts, and the command waits for it
    after = replicas(cluster)
    (added,) = set(after) - set(before)
    assert drained not in after and after[added]["state"] == "live"
    assert f"added {added} · removed {drained}" in up.stdout
    client = http(cluster)
    assert new_session(client, "scaled") == added  # the new replica has been given the fewest requests
    turn(client, "scaled", "What is the capital of France?")
    down = admin.post("/v1/cluster/scale", json={"replicas": 1})  # the highest number goes: the new one
    assert down.status_code == 200 and down.json()["removed"] == [added], down.text
    assert_adopted_with_its_kv(client, "scaled", added)
    question = "And of Portugal?"
    expected = stateless_reference(client, "scaled", question)
    answer = turn(client, "scaled", question)
    assert answer.headers[REPLICA] != added and list(replicas(cluster)) == [answer.headers[REPLICA]]
    assert answer.json()["choices"][0]["message"]["content"] == expected
