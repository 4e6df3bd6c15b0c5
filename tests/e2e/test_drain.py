"""Graceful drain on SIGTERM: running streams finish, new requests get 503, sessions are saved, exit status 0."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.conftest import start_server, stop_server

KEY_A, KEY_B = "drain-key-a", "drain-key-b"


def server_args(state: Path, drain_timeout: float) -> list[str]:
    """A keyed default-model server on state with the given drain timeout."""
    args = ["--model", "default", "--kv-cache-memory", "512MiB", "--state-dir", str(state)]
    return [*args, "--api-key", KEY_A, "--api-key", KEY_B, "--drain-timeout", str(drain_timeout)]


class Stream:
    """A streamed session turn read on a thread: its data lines, and whether it ended with [DONE]."""

    def __init__(self, url: str, session_id: str, max_tokens: int) -> None:
        self.lines: list[str] = []
        self.started = threading.Event()
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "session_id": session_id,
        }
        self.thread = threading.Thread(target=self._read, args=(url, body))
        self.thread.start()
        assert self.started.wait(120), "the stream did not start"

    def _read(self, url: str, body: dict[str, Any]) -> None:
        headers = {"Authorization": f"Bearer {KEY_A}"}
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line.removeprefix("data: "))
                        self.started.set()
        except httpx.HTTPError:
            pass  # a stream cut at the drain timeout
        finally:
            self.started.set()

    def finish_reasons(self) -> list[str]:
        """Finish reasons of the chunks received."""
        chunks = [json.loads(line) for line in self.lines if line != "[DONE]"]
        return [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"] if choice["finish_reason"]]


def test_sigterm_lets_a_stream_finish_refuses_new_requests_and_saves_sessions(tmp_path: Path) -> None:
    state = tmp_path / "state"
    process, url = start_server(server_args(state, drain_timeout=120), tmp_path / "first.log")
    a = httpx.Client(base_url=url, headers={"X-Api-Key": KEY_A}, timeout=60)
    try:
        assert a.post("/v1/sessions", json={"session_id": "drained"}).status_code == 201
        stream = Stream(url, "drained", max_tokens=400)  # still running while the drain is checked
        process.terminate()
        time.sleep(0.5)
        refused = a.get("/v1/models")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert int(refused.headers["retry-after"]) >= 1
        assert a.get("/health").json()["status"] == "draining"
        stream.thread.join(120)
        assert process.wait(60) == 0
    finally:
        a.close()
        stop_server(process)
    assert stream.lines[-1] == "[DONE]" and stream.finish_reasons() == ["length"]
    saved = json.loads((state / "sessions" / "drained" / "transcript.json").read_text())
    assert [message["role"] for message in saved] == ["user", "assistant"]

    process, url = start_server(server_args(state, drain_timeout=1), tmp_path / "second.log")
    try:
        with httpx.Client(base_url=url, headers={"X-Api-Key": KEY_A}, timeout=60) as a:
            assert a.get("/v1/sessions/drained/history").json()["messages"] == saved
        with httpx.Client(base_url=url, headers={"X-Api-Key": KEY_B}, timeout=60) as b:
            assert b.get("/v1/sessions/drained").status_code == 404  # the resumed session keeps its owner
        started = time.monotonic()
        cut = Stream(url, "drained", max_tokens=2000)
        process.terminate()
        assert process.wait(60) == 0
        assert time.monotonic() - started < 30
    finally:
        stop_server(process)
    cut.thread.join(60)
    assert "[DONE]" not in cut.lines  # cut at the drain timeout: the turn is dropped, the session kept as it was
    assert json.loads((state / "sessions" / "drained" / "transcript.json").read_text()) == saved
