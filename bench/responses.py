"""Responses API: follow-up latency of a long chain through previous_response_id against the same request re-sent.

Usage: .venv/bin/python -m bench.responses [--url URL] [--context-tokens 2000] [--runs 5]

A chain of stored responses is grown to about --context-tokens tokens through previous_response_id (user
messages of about 250 tokens, replies of up to 24). Then one more response is timed three ways, each a
non-streamed request with max_output_tokens=1 (prefill plus one token), median of --runs:

- chained: `previous_response_id` and only the new message; stored (as a client does by default) and deleted
  after each run, so every run continues the same chain;
- re-sent, warm: the whole conversation as `input` items with `store: false` (what a client of a server
  without stored responses sends), here with statelm's prefix cache warm from the chain;
- re-sent, cold: the same behind `instructions` that differ in their first token, so that nothing is cached
  (what a server without a prefix cache computes).

Without --url it starts `statelm serve --model default` itself with a temporary state dir.
"""

from __future__ import annotations

import functools
import statistics
import time
import uuid
from typing import Any

import httpx

from bench.common import run_context_benchmark
from bench.sessions import PARAGRAPH

INSTRUCTIONS = "You answer in one short sentence."


def respond(http: httpx.Client, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Seconds a greedy response took, and the response."""
    started = time.perf_counter()
    response = http.post("/v1/responses", json={"model": "default", "temperature": 0, **body})
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, response.json()


def grow_chain(http: httpx.Client, context_tokens: int) -> tuple[str, list[dict[str, Any]], int]:
    """Responses of about 250 tokens each until the chain holds context_tokens; its head, history and size."""
    head, history, held, turn = None, [], 0, 0
    while held < context_tokens:
        turn += 1
        message = {"role": "user", "content": f"Note {turn}. " + PARAGRAPH * 5 + "What is this note about?"}
        body = {"input": [message], "instructions": INSTRUCTIONS, "max_output_tokens": 24, "previous_response_id": head}
        _, response = respond(http, body)
        head = response["id"]
        history += [message, {"role": "assistant", "content": response["output_text"]}]
        held = response["usage"]["input_tokens"] + response["usage"]["output_tokens"]
    return str(head), history, held


def own_question(number: int, mode: str) -> dict[str, str]:
    """A question no other request of the run asks, so that none finds another's question in the prefix cache."""
    return {"role": "user", "content": f"{mode.capitalize()} question {number + 1}: which note was windy?"}


def run(http: httpx.Client, context_tokens: int, runs: int) -> None:
    """Measure and print the three follow-ups."""
    head, history, held = grow_chain(http, context_tokens)
    results: dict[str, list[tuple[float, dict[str, Any]]]] = {"chained": [], "warm": [], "cold": []}
    for number in range(runs):
        question = functools.partial(own_question, number)
        chained = respond(http, {"input": [question("chained")], "instructions": INSTRUCTIONS,
                                 "previous_response_id": head, "max_output_tokens": 1})  # fmt: skip
        results["chained"].append(chained)
        http.delete(f"/v1/responses/{chained[1]['id']}").raise_for_status()
        full = {"store": False, "max_output_tokens": 1}
        warm = {**full, "input": [*history, question("warm")], "instructions": INSTRUCTIONS}
        results["warm"].append(respond(http, warm))
        cold = {**full, "input": [*history, question("cold")], "instructions": f"{uuid.uuid4().hex} {INSTRUCTIONS}"}
        results["cold"].append(respond(http, cold))
    median = {mode: statistics.median(elapsed for elapsed, _ in rows) for mode, rows in results.items()}
    usage = {mode: rows[-1][1]["usage"] for mode, rows in results.items()}
    print(f"\nfollow-up on a {held}-token chain ({usage['cold']['input_tokens']} input tokens re-sent), "
          "max_output_tokens=1, medians:")  # fmt: skip
    labels = {
        "chained": "previous_response_id      ",
        "warm": "full input, prefix warm   ",
        "cold": "full input, cold          ",
    }
    for mode, label in labels.items():
        runs_ms = ", ".join(f"{elapsed * 1000:.0f}" for elapsed, _ in results[mode])
        cached = usage[mode]["input_tokens_details"]["cached_tokens"]
        print(f"  {label} {median[mode] * 1000:8.1f} ms  input {usage[mode]['input_tokens']:5d}  cached {cached:5d}"
              f"  (runs: {runs_ms} ms)")  # fmt: skip
    print(f"  chained / cold = 1/{median['cold'] / median['chained']:.1f}, "
          f"chained / warm = 1/{median['warm'] / median['chained']:.1f}")  # fmt: skip


def main() -> None:
    run_context_benchmark(__doc__ or "", 8018, "chain of", run)


if __name__ == "__main__":
    main()
