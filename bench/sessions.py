"""Sessions and snapshots: follow-up TTFT against stateless requests, snapshot load against prefill, size on disk.

Usage: .venv/bin/python -m bench.sessions [--url URL] [--context-tokens 2000] [--runs 5]

(a) A conversation is grown to about --context-tokens tokens in a session. Then the time to first token
    of one more turn is measured three ways: as a session turn (only the new message is sent), stateless
    with the full history and a warm prefix cache, and stateless with the same history behind a system
    prompt that differs in its first token (nothing in the prefix cache matches: a cold prefill).
    A request with max_tokens=1 is timed (prefill plus one token); the session is rolled back after each
    session turn so every run sees the same conversation.
(b) The session is saved as a snapshot and loaded into a new session (read, checksums, copy into the
    pool), against the cold prefill of the same tokens. The snapshot files were just written, so they
    are read from the page cache.
(c) The snapshot's bytes on disk per token.
Without --url it starts `statelm serve --model default` itself with a temporary state dir.
"""

from __future__ import annotations

import statistics
import time
import uuid

import httpx

from bench.common import run_context_benchmark

PARAGRAPH = (
    "The observatory on the hill kept records of every storm for ninety years. Each entry gave the date, "
    "the wind, the pressure and a line or two about the sky. "
)


def timed(call: httpx.Client, method: str, path: str, body: dict) -> tuple[float, dict]:
    """Seconds the request took, and its JSON answer."""
    started = time.perf_counter()
    response = call.request(method, path, json=body)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, response.json()


def grow_conversation(http: httpx.Client, session_id: str, context_tokens: int) -> tuple[list[dict], int]:
    """Turns of about 250 tokens each until the session holds context_tokens; returns the transcript."""
    http.post("/v1/sessions", json={"session_id": session_id, "system": "You answer in one short sentence."})
    held, turn = 0, 0
    while held < context_tokens:
        turn += 1
        message = {"role": "user", "content": f"Note {turn}. " + PARAGRAPH * 5 + "What is this note about?"}
        body = {"model": "default", "messages": [message], "temperature": 0, "max_tokens": 24, "session_id": session_id}
        http.post("/v1/chat/completions", json=body).raise_for_status()
        held = http.get(f"/v1/sessions/{session_id}").json()["num_tokens"]
    return http.get(f"/v1/sessions/{session_id}/history").json()["messages"], held


def main() -> None:
    run_context_benchmark(__doc__ or "", 8017, "context", run)


def ask(http: httpx.Client, messages: list[dict], session_id: str | None = None) -> tuple[float, int, int]:
    """Seconds for a greedy one-token reply (prefill plus one token), prompt tokens and cached tokens."""
    body = {"model": "default", "temperature": 0, "max_tokens": 1, "messages": messages}
    if session_id is not None:
        body["session_id"] = session_id
    elapsed, reply = timed(http, "POST", "/v1/chat/completions", body)
    return elapsed, reply["usage"]["prompt_tokens"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def run(http: httpx.Client, context_tokens: int, runs: int) -> None:
    """Measure and print (a), (b) and (c)."""
    session_id = f"bench-{uuid.uuid4().hex[:8]}"
    transcript, held = grow_conversation(http, session_id, context_tokens)
    question = {"role": "user", "content": "Which note mentioned the wind first?"}
    results: dict[str, list[tuple[float, int, int]]] = {"session": [], "warm": [], "cold": []}
    for _ in range(runs):
        results["session"].append(ask(http, [question], session_id))
        http.post(f"/v1/sessions/{session_id}/rollback", json={"keep_messages": len(transcript)})
        results["warm"].append(ask(http, [*transcript, question]))
        system = {"role": "system", "content": f"{uuid.uuid4().hex} {transcript[0]['content']}"}
        results["cold"].append(ask(http, [system, *transcript[1:], question]))
    ttft = {mode: statistics.median(r[0] for r in rows) for mode, rows in results.items()}
    cached = {mode: rows[-1][2] for mode, rows in results.items()}
    print(f"\n(a) TTFT of a follow-up turn on a {held}-token conversation ({results['cold'][-1][1]} prompt tokens)")
    print(f"  session turn                 {ttft['session'] * 1000:8.1f} ms  cached {cached['session']}")
    print(f"  stateless, prefix cache warm {ttft['warm'] * 1000:8.1f} ms  cached {cached['warm']}")
    print(f"  stateless, cold              {ttft['cold'] * 1000:8.1f} ms  cached {cached['cold']}")
    print(f"  session / cold = 1/{ttft['cold'] / ttft['session']:.1f} (target: at most 1/5)")
    cold_ttft = ttft["cold"]

    _, snapshot = timed(http, "POST", f"/v1/sessions/{session_id}/snapshot", {"title": "bench"})
    load_s = []
    for _ in range(runs):
        elapsed, loaded = timed(http, "POST", f"/v1/snapshots/{snapshot['id']}/load",
                                {"session_id": f"{session_id}-restored", "overwrite": True})  # fmt: skip
        load_s.append(elapsed)
    load = statistics.median(load_s)
    print(f"\n(b) snapshot of {snapshot['num_tokens']} tokens: load {load * 1000:.1f} ms (into a session of "
          f"{loaded['num_tokens']} tokens) vs cold prefill {cold_ttft * 1000:.1f} ms: {cold_ttft / load:.1f}x faster "
          "(target: at least 10x)")  # fmt: skip
    print(f"\n(c) snapshot size: {snapshot['size_bytes'] / 2**20:.1f} MiB for {snapshot['num_tokens']} tokens = "
          f"{snapshot['size_bytes'] / snapshot['num_tokens'] / 1024:.1f} KiB per token")  # fmt: skip


if __name__ == "__main__":
    main()
