"""Prompt caching on /v1/messages in-process, on the tiny model with a KV pool of 64 blocks: a breakpoint's prefix
is reported as written, then as read, and is pinned, so that it survives a burst of unrelated prompts that evicts
the same prefix sent without a breakpoint; /metrics counts the pin."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from statelm.engine.block_pool import common_prefix_length
from tests.http.conftest import InProcessServer, serve_in_process, tiny_args

BLOCK_SIZE = 16
POOL_BLOCKS = 64
# float32 KV on every CPU (auto is 16-bit): 8 KiB a tiny-model block
SMALL_POOL = ["--dtype", "float32", "--kv-cache-dtype", "float32", "--kv-cache-memory", "512KiB",
              "--pinned-kv-fraction-per-key", "0.5"]  # fmt: skip
BURST = [f"Question {n}: tell me everything about topic number {n}. " * 12 for n in range(8)]  # all over the pool


@pytest.fixture(scope="module")
def small_pool(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """Raw HTTP to an app whose KV pool holds 64 blocks, a few prompts' worth."""
    state = tmp_path_factory.mktemp("anthropic-cache") / "state"
    app: InProcessServer
    with serve_in_process(tiny_args(tiny_model, state, *SMALL_POOL)) as app, app.http() as http:
        assert metric(http, "statelm_kv_blocks_free") == POOL_BLOCKS
        yield http


def metric(http: httpx.Client, name: str) -> float:
    """The current value of an unlabelled metric."""
    match = re.search(rf"^{name} ([0-9.e+-]+)$", http.get("/metrics").text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def system_blocks(text: str, breakpoint: bool) -> list[dict[str, Any]]:
    """A system prompt as one text block, with a cache_control breakpoint if asked."""
    block: dict[str, Any] = {"type": "text", "text": text}
    return [{**block, "cache_control": {"type": "ephemeral"}}] if breakpoint else [block]


def usage(http: httpx.Client, system: list[dict[str, Any]] | None, question: str) -> dict[str, int]:
    """The usage of a one-token greedy message."""
    body: dict[str, Any] = {"model": "default", "max_tokens": 1, "temperature": 0}
    body["messages"] = [{"role": "user", "content": question}]
    if system is not None:
        body["system"] = system
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def token_ids(http: httpx.Client, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """The conversation as the template renders it, in token ids."""
    body = {"model": "default", "messages": messages, "add_generation_prompt": add_generation_prompt}
    return http.post("/tokenize", json=body).json()["tokens"]


def prompt_ids(http: httpx.Client, system: str, question: str) -> list[int]:
    """The prompt of a question under a system prompt, in token ids."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return token_ids(http, messages, add_generation_prompt=True)


def prefix_length(http: httpx.Client, system: str, question: str) -> int:
    """The tokens of the prompt that the system prompt's own rendering starts it with, in whole blocks."""
    head = token_ids(http, [{"role": "system", "content": system}], add_generation_prompt=False)
    shared = common_prefix_length(head, prompt_ids(http, system, question))
    return shared - shared % BLOCK_SIZE


def served_after(http: httpx.Client, system: str, earlier: str, question: str) -> int:
    """The tokens the prefix cache serves a question's prompt from an earlier question's under the same system
    prompt: those they share, to the token, within the earlier prompt's full blocks, leaving one to compute."""
    first, prompt = prompt_ids(http, system, earlier), prompt_ids(http, system, question)
    return min(common_prefix_length(first, prompt), len(first) - len(first) % BLOCK_SIZE, len(prompt) - 1)


def burst(http: httpx.Client) -> None:
    """Unrelated prompts that together need more blocks than the pool has."""
    for question in BURST:
        assert usage(http, None, question)["cache_read_input_tokens"] < BLOCK_SIZE  # at most the template's opening


def test_a_system_prompt_without_a_breakpoint_is_evicted_by_a_burst(small_pool: httpx.Client) -> None:
    system = "Rivers: you are an assistant who answers questions about them. " * 6
    assert usage(small_pool, system_blocks(system, False), "Longest?")["cache_creation_input_tokens"] == 0
    cached = usage(small_pool, system_blocks(system, False), "Widest?")
    prefix = prefix_length(small_pool, system, "Widest?")
    assert prefix >= 4 * BLOCK_SIZE  # the automatic prefix cache serves the whole blocks and the shared tokens after
    assert cached["cache_read_input_tokens"] == served_after(small_pool, system, "Longest?", "Widest?") >= prefix
    burst(small_pool)
    after = usage(small_pool, system_blocks(system, False), "Deepest?")
    assert after["cache_read_input_tokens"] < BLOCK_SIZE


def test_a_breakpoint_reports_the_prefix_written_then_read_and_pins_it_through_a_burst(
    small_pool: httpx.Client,
) -> None:
    system = "Mountains: you are an assistant who answers questions about them. " * 6
    prefix = prefix_length(small_pool, system, "Highest?")
    assert prefix >= 4 * BLOCK_SIZE
    created = metric(small_pool, "statelm_cache_pins_created_total")
    first = usage(small_pool, system_blocks(system, True), "Highest?")
    assert first["cache_read_input_tokens"] < BLOCK_SIZE  # at most the template's opening, shared with earlier prompts
    assert first["cache_creation_input_tokens"] + first["cache_read_input_tokens"] == prefix
    second = usage(small_pool, system_blocks(system, True), "Oldest?")
    assert second["cache_read_input_tokens"] == served_after(small_pool, system, "Highest?", "Oldest?") >= prefix
    assert second["cache_creation_input_tokens"] == 0
    assert metric(small_pool, "statelm_cache_pins_created_total") == created + 1
    assert metric(small_pool, "statelm_kv_blocks_pinned") == prefix // BLOCK_SIZE
    hits = metric(small_pool, "statelm_cache_pin_hits_total")
    burst(small_pool)
    after = usage(small_pool, system_blocks(system, True), "Steepest?")
    assert after["cache_read_input_tokens"] == prefix and after["cache_creation_input_tokens"] == 0
    assert metric(small_pool, "statelm_cache_pin_hits_total") == hits + 1
    assert metric(small_pool, "statelm_cache_pins_released_under_pressure_total") == 0
    unmarked = usage(small_pool, system_blocks(system, False), "Coldest?")  # the pin serves it too
    assert unmarked["cache_read_input_tokens"] == served_after(small_pool, system, "Steepest?", "Coldest?") >= prefix
    assert unmarked["cache_creation_input_tokens"] == 0


def test_a_breakpoint_past_the_keys_cap_is_cached_without_a_pin(small_pool: httpx.Client) -> None:
    system = "Forests: you are an assistant who answers questions about them and the animals in them. " * 10
    prefix = prefix_length(small_pool, system, "Largest?")
    assert prefix > POOL_BLOCKS // 2 * BLOCK_SIZE  # more than the key's half of the pool
    refused = metric(small_pool, "statelm_cache_pins_refused_total")
    pinned = metric(small_pool, "statelm_kv_blocks_pinned")
    first = usage(small_pool, system_blocks(system, True), "Largest?")
    assert first["cache_read_input_tokens"] < BLOCK_SIZE
    assert first["cache_creation_input_tokens"] + first["cache_read_input_tokens"] == prefix
    assert metric(small_pool, "statelm_cache_pins_refused_total") == refused + 1
    assert metric(small_pool, "statelm_kv_blocks_pinned") == pinned
    second = usage(small_pool, system_blocks(system, True), "Oldest?")
    assert second["cache_read_input_tokens"] == served_after(small_pool, system, "Largest?", "Oldest?") >= prefix
