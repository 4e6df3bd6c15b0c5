"""A real server whose state directory is a small file system (a 16 MiB tmpfs) that fills up, then turns read-only.

The file system is filled to the last byte; then every state-changing route is tried: each answers 2xx (what it did
is durable) or 507 (nothing of it is kept), while requests that keep nothing are served. Then SIGKILL, the space
freed, a restart: every change answered 2xx is there, none answered 507 is. Then the file system is remounted
read-only: changes are refused, /health says so, and it heals when remounted read-write.

Mounting needs root (CAP_SYS_ADMIN), as in CI's container; elsewhere the test skips, saying why. The fault-injecting
store (tests/http/test_storage_faults.py) covers the same paths without a mount.
"""

from __future__ import annotations

import contextlib
import errno
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import start_server, stop_server
from tests.http.conftest import CONTEXT, tiny_args
from tests.models.tiny_model_dir import make_tiny_model_dir

SIZE = "16m"
TURN = {"model": "default", "max_tokens": 6, "temperature": 0}
Messages = list[dict[str, Any]]


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted for the test (skipped where the machine does not allow mounting)."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={SIZE},mode=0700", "tmpfs", str(mount_point)],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("no mount command on this machine")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the file system is full; the file."""
    filler = directory / "filler"
    chunk = b"\0" * 65536
    with filler.open("wb") as file:
        try:
            while True:
                file.write(chunk)
                file.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    with contextlib.suppress(OSError), filler.open("ab") as file:  # the last bytes that fit
        while True:
            file.write(b"\0")
            file.flush()
    return filler


def answer(response: httpx.Response, ok: int) -> bool:
    """True if the change was answered ok, False if refused 507 (in OpenAI's shape, with Retry-After)."""
    if response.status_code == ok:
        return True
    assert response.status_code == 507, response.text
    assert response.headers["retry-after"] and response.json()["error"]["code"] == "insufficient_storage"
    assert "could not save" in response.json()["error"]["message"]
    return False


def history(http: httpx.Client, session_id: str) -> Messages | None:
    response = http.get(f"/v1/sessions/{session_id}/history")
    return None if response.status_code == 404 else [(m["role"], m.get("content")) for m in response.json()["messages"]]


def streamed_turn(http: httpx.Client, session_id: str, content: str) -> str | None:
    """A streamed session turn: the reply if its end was sent, None if the stream ended in a refusal."""
    body = {**TURN, "session_id": session_id, "stream": True, "messages": [{"role": "user", "content": content}]}
    reply, finished, refused = "", False, False
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                assert event["error"]["code"] == "insufficient_storage"
                refused = True
                continue
            for choice in event["choices"]:
                reply += choice["delta"].get("content") or ""
                finished |= choice.get("finish_reason") is not None
    assert finished != refused
    return reply if finished else None


def serves_what_keeps_nothing(http: httpx.Client) -> None:
    """Stateless requests, on each API, are served whatever the disk."""
    messages = [{"role": "user", "content": "Hi"}]
    assert http.post("/v1/chat/completions", json={**TURN, "messages": messages}).status_code == 200
    assert http.post("/v1/messages", json={**TURN, "messages": messages}).status_code == 200
    body = {"model": "default", "input": "Hi", "store": False, "max_output_tokens": 4}
    assert http.post("/v1/responses", json=body).status_code == 200


@pytest.mark.timeout(300)
def test_a_full_then_read_only_state_filesystem_loses_nothing_answered(small_filesystem: Path, tmp_path: Path) -> None:
    model = make_tiny_model_dir("qwen2", tmp_path / "model", max_position_embeddings=CONTEXT)
    state = small_filesystem / "state"
    args = tiny_args(model, state)
    process, url = start_server(args, tmp_path / "first.log")
    expected: dict[str, Messages] = {}
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            for session_id in ("a", "b"):
                assert http.post("/v1/sessions", json={"session_id": session_id}).status_code == 201
                body = {**TURN, "session_id": session_id, "messages": [{"role": "user", "content": "One."}]}
                assert http.post("/v1/chat/completions", json=body).status_code == 200
                expected[session_id] = history(http, session_id) or []
            snapshot = http.post("/v1/sessions/a/snapshot", json={"title": "before"}).json()
            snapshotted = list(expected["a"])
            response = http.post("/v1/responses", json={"model": "default", "input": "One.", "max_output_tokens": 4})
            stored = {response.json()["id"]: response.json()}
            metadata = {"b": {}}

            filler = fill(small_filesystem)
            serves_what_keeps_nothing(http)
            if answer(http.post("/v1/sessions", json={"session_id": "c"}), 201):
                expected["c"] = []
            body = {**TURN, "session_id": "a", "messages": [{"role": "user", "content": "Two."}]}
            response = http.post("/v1/chat/completions", json=body)
            if answer(response, 200):
                expected["a"] += [("user", "Two."), ("assistant", response.json()["choices"][0]["message"]["content"])]
            reply = streamed_turn(http, "a", "Three.")
            if reply is not None:
                expected["a"] += [("user", "Three."), ("assistant", reply)]
            serves_what_keeps_nothing(http)
            if answer(http.post("/v1/sessions/a/fork", json={"session_id": "a-fork"}), 201):
                expected["a-fork"] = list(expected["a"])
            if answer(http.patch("/v1/sessions/b", json={"metadata": {"k": "v"}}), 200):
                metadata["b"] = {"k": "v"}
            if answer(http.post("/v1/sessions/a/rollback", json={"keep_messages": 0}), 200):
                expected["a"] = []
            if answer(http.delete("/v1/sessions/b"), 200):
                del expected["b"]
            load = http.post(f"/v1/snapshots/{snapshot['id']}/load", json={"session_id": "loaded"})
            if answer(load, 201):
                expected["loaded"] = snapshotted
            new_snapshot = http.post("/v1/sessions/a/snapshot", json={})
            snapshots = {snapshot["id"]} | ({new_snapshot.json()["id"]} if answer(new_snapshot, 201) else set())
            body = {
                "model": "default",
                "input": "Two.",
                "max_output_tokens": 4,
                "previous_response_id": next(iter(stored)),
            }
            response = http.post("/v1/responses", json=body)
            if answer(response, 200):
                stored[response.json()["id"]] = response.json()
            serves_what_keeps_nothing(http)
            health = http.get("/health")
            assert health.status_code == 200 and health.json()["state_dir"]["condition"] == "full"
            refusals = [line for line in http.get("/metrics").text.splitlines()
                        if line.startswith('statelm_storage_refusals_total{cause="full"}')]  # fmt: skip
            assert float(refusals[0].split()[-1]) >= 1
            assert "c" not in expected  # a new session's journal needs room: the full disk refused it
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()

    filler.unlink()
    process, url = start_server(args, tmp_path / "second.log")
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            held = {session["id"] for session in http.get("/v1/sessions").json()["data"]}
            assert held == set(expected)  # every creation answered is there, every refused one is not
            for session_id, transcript in expected.items():
                assert history(http, session_id) == transcript, session_id
            if "b" in expected:
                assert http.get("/v1/sessions/b").json()["metadata"] == metadata["b"]
            assert {s["id"] for s in http.get("/v1/snapshots").json()["data"]} == snapshots
            for response_id, response in stored.items():
                assert http.get(f"/v1/responses/{response_id}").json()["output_text"] == response["output_text"]

            subprocess.run(["mount", "-o", "remount,ro", str(small_filesystem)], check=True)
            try:
                refused = http.post("/v1/sessions", json={"session_id": "read-only"})
                assert not answer(refused, 201) and "read-only" in refused.json()["error"]["message"]
                assert http.get("/health").json()["state_dir"]["condition"] == "read-only"
                serves_what_keeps_nothing(http)
            finally:
                subprocess.run(["mount", "-o", "remount,rw", str(small_filesystem)], check=True)
            deadline = time.monotonic() + 10
            while http.get("/health").json()["state_dir"]["condition"] != "ok":
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert http.post("/v1/sessions", json={"session_id": "read-only"}).status_code == 201
    finally:
        stop_server(process)
