"""Serving under load on the default model: batch invariance, prefix cache, cancellation, health, metrics."""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import start_server, stop_server

TOPICS = ["the sea", "a mountain", "coffee", "winter", "a library", "trains", "the moon", "bees",
          "a violin", "rain", "chess", "bread", "a lighthouse", "autumn", "the desert", "owls"]  # fmt: skip


def metric(server_url: str, name: str) -> float:
    """Current value of an unlabelled metric."""
    text = httpx.get(f"{server_url}/metrics").text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


async def ask(client: openai.AsyncOpenAI, model: str, topic: str, max_tokens: int = 24, **kwargs: object) -> str:
    reply = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Write about {topic}."}], max_tokens=max_tokens, **kwargs
    )
    return reply.choices[0].message.content


@pytest.fixture
def async_client(server_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 5}])
def test_sixteen_concurrent_requests_equal_each_alone(
    async_client: openai.AsyncOpenAI, model_name: str, sampling: dict
) -> None:
    async def run() -> tuple[list[str], list[str]]:
        alone = [await ask(async_client, model_name, topic, **sampling) for topic in TOPICS]
        together = await asyncio.gather(*(ask(async_client, model_name, topic, **sampling) for topic in TOPICS))
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone


def test_shared_prefix_is_served_from_the_cache(client: openai.OpenAI, model_name: str) -> None:
    system = "You are a careful assistant. " + "Answer briefly and politely. " * 60
    usages = []
    for question in ("What is two plus two?", "Name a colour."):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        reply = client.chat.completions.create(model=model_name, messages=messages, temperature=0, max_tokens=4)
        usages.append(reply.usage)
    assert usages[0].prompt_tokens >= 300
    assert usages[1].prompt_tokens_details.cached_tokens >= 256
    assert usages[1].prompt_tokens_details.cached_tokens < usages[1].prompt_tokens


def test_disconnected_stream_frees_its_sequence(server_url: str, model_name: str) -> None:
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server_url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(server_url, "statelm_requests_running") == 1
    deadline = time.monotonic() + 1.0
    while metric(server_url, "statelm_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server_url, "statelm_requests_running") == 0
    assert metric(server_url, "statelm_kv_blocks_used") == 0


def test_health_answers_fast_while_sixteen_streams_generate(server_url: str, model_name: str) -> None:
    async def run() -> list[float]:
        client = openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)
        streams = [
            asyncio.create_task(ask(client, model_name, topic, extra_body={"ignore_eos": True}, max_tokens=128))
            for topic in TOPICS
        ]
        latencies = []
        async with httpx.AsyncClient() as http:
            while metric(server_url, "statelm_requests_running") < 2:  # let the batch form (on a GPU within ms)
                assert not all(stream.done() for stream in streams), "the streams ended before two ran at once"
                await asyncio.sleep(0.02)
            while len(latencies) < 20 and not all(stream.done() for stream in streams):
                started = time.perf_counter()
                assert (await http.get(f"{server_url}/health")).status_code == 200
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(0.05)
        await asyncio.gather(*streams)
        return latencies

    latencies = asyncio.run(run())
    assert len(latencies) >= 5, f"only {len(latencies)} health checks while the streams ran"
    assert statistics.median(latencies) < 0.1 and max(latencies) < 0.5, latencies


def test_metrics_count_requests_and_tokens(client: openai.OpenAI, server_url: str, model_name: str) -> None:
    before = metric(server_url, "statelm_generation_tokens_total")
    client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert metric(server_url, "statelm_generation_tokens_total") == before + 5
    text = httpx.get(f"{server_url}/metrics").text
    assert 'statelm_http_responses_total{route="/v1/chat/completions",status="200"}' in text
    assert "statelm_time_to_first_token_seconds_count" in text
    assert metric(server_url, "statelm_kv_blocks_free") > 0


def test_full_queue_answers_429(tmp_path: Path) -> None:
    process, url = start_server(
        ["--model", "default", "--max-num-seqs", "1", "--max-queue", "1", "--kv-cache-memory", "64MiB"],
        tmp_path / "server.log",
    )
    try:
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 48,
            "ignore_eos": True,
        }

        async def run() -> list[int]:
            async with httpx.AsyncClient(timeout=120) as http:
                long_stream = {**body, "max_tokens": 1000, "stream": True}
                async with http.stream("POST", f"{url}/v1/chat/completions", json=long_stream) as first:
                    lines = first.aiter_lines()  # kept open: the first request holds the only slot
                    assert (await anext(lines)).startswith("data:")
                    second = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=body))
                    await asyncio.sleep(0.3)  # the second waits in the one-place queue
                    third = await http.post(f"{url}/v1/chat/completions", json=body)
                    assert third.status_code == 429, third.text
                    assert third.json()["error"]["type"] == "rate_limit_error"
                # closing the first stream cancels it; the queued second then runs
                return [first.status_code, (await second).status_code, third.status_code]

        assert asyncio.run(run()) == [200, 200, 429]
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        stop_server(process)
