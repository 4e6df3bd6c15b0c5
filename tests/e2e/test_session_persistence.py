"""Sessions under memory pressure and across restarts, on a server whose KV pool holds only 20 blocks."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from tests.e2e.conftest import start_server, stop_server

BYTES_PER_BLOCK = 30 * 2 * 16 * 3 * 64 * 2  # SmolLM2-135M, 16-bit KV: layers × (K, V) × block × kv heads × dim × 2 B
POOL_BLOCKS = 20
NAMES = ["Ada", "Bob", "Cleo", "Dan", "Eve", "Finn"]


def server_args(state: Path, *extra: str) -> list[str]:
    """A default-model server with a tiny KV pool on the given state dir."""
    pool = str(POOL_BLOCKS * BYTES_PER_BLOCK)
    return ["--model", "default", "--kv-cache-memory", pool, "--state-dir", str(state), *extra]


def ask(client: openai.OpenAI, messages: list[dict[str, str]], session_id: str | None = None) -> tuple[str, int]:
    """Greedy reply and cached prompt tokens, as a session turn or stateless."""
    extra = {"session_id": session_id} if session_id else None
    reply = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=12, extra_body=extra
    )
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens_details.cached_tokens


def test_sessions_spill_under_pressure_and_survive_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    process, url = start_server(server_args(state), tmp_path / "first.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        transcripts: dict[str, list[dict[str, str]]] = {}
        for name in NAMES:
            assert httpx.post(f"{url}/v1/sessions", json={"session_id": name}).status_code == 201
            transcripts[name] = []
            introduction = f"Hello, my name is {name}. I live in a small town by the sea and I paint. Greet me."
            for question in (introduction, "Which city is the capital of Italy?"):
                message = {"role": "user", "content": question}
                reply, _ = ask(client, [message], name)
                transcripts[name] += [message, {"role": "assistant", "content": reply}]
        states = {s["id"]: s for s in httpx.get(f"{url}/v1/sessions").json()["data"]}
        assert sum(s["state"] == "spilled" for s in states.values()) >= 2, states
        for name in NAMES:  # every session, spilled or not, continues exactly as the full history would
            held = httpx.get(f"{url}/v1/sessions/{name}").json()["num_tokens"]
            question = {"role": "user", "content": "What is my name?"}
            reply, cached = ask(client, [question], name)
            assert cached >= held - 1, (name, cached, held)
            assert reply == ask(client, [*transcripts[name], question])[0]
            transcripts[name] += [question, {"role": "assistant", "content": reply}]
        kept = httpx.get(f"{url}/v1/sessions/Ada").json()["num_tokens"]
    finally:
        stop_server(process)
    assert process.returncode == 0
    assert sorted(path.name for path in (state / "sessions").iterdir()) == sorted(NAMES)

    process, url = start_server(server_args(state), tmp_path / "second.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        listed = {s["id"]: s for s in httpx.get(f"{url}/v1/sessions").json()["data"]}
        assert sorted(listed) == sorted(NAMES)
        assert listed["Ada"]["state"] == "spilled" and listed["Ada"]["num_tokens"] == kept
        assert httpx.get(f"{url}/v1/sessions/Ada/history").json()["messages"] == transcripts["Ada"]
        question = {"role": "user", "content": "Thank you. Say goodbye."}
        reply, cached = ask(client, [question], "Ada")
        assert cached >= kept - 1
        assert reply == ask(client, [*transcripts["Ada"], question])[0]
    finally:
        stop_server(process)

    process, url = start_server(server_args(state, "--no-persist-sessions"), tmp_path / "third.log")
    try:
        assert httpx.get(f"{url}/v1/sessions").json()["data"] == []
    finally:
        stop_server(process)
    assert (state / "sessions" / "Ada").is_dir()  # a server that does not persist leaves saved sessions alone
