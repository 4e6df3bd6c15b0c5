"""The engine on a tiny real model: chunked prefill, prefix cache, preemption and batching change no output."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from statelm.config import EngineConfig
from statelm.engine import engine as engine_module
from statelm.engine.async_engine import DEGRADED_AFTER_FAILED_STEPS, AsyncEngine
from statelm.engine.builder import create_engine, kv_cache_format
from statelm.engine.cache_pins import CachePinRequest
from statelm.engine.client import EngineRequest, RequestOutput
from statelm.engine.engine import Engine
from statelm.engine.kv_cache import KVCache
from statelm.engine.sequence import SamplingParams
from statelm.models.loader import LoadedModel, load_model
from tests.models.engine_run import generate
from tests.models.tiny_model_dir import make_tiny_model_dir

LAYER_TYPES = ["sliding_attention", "full_attention"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(qwen2_dir: Path) -> LoadedModel:
    return load_model(str(qwen2_dir), torch.device("cpu"), torch.float32)


def engine_for(loaded: LoadedModel, **settings: object) -> Engine:
    return create_engine(loaded, EngineConfig(**{"kv_cache_memory": 8 << 20, **settings}))


def prompts(loaded: LoadedModel, count: int, words: int = 40) -> dict[str, list[int]]:
    encode = loaded.tokenizer.encode
    return {f"r{i}": encode(f"Request {i}: " + "the quick brown fox " * (words // 4)) for i in range(count)}


def test_prompt_longer_than_the_step_budget_is_prefilled_in_chunks(loaded: LoadedModel) -> None:
    prompt = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
    assert len(prompt) > 100
    outputs = [
        generate(engine_for(loaded, max_num_batched_tokens=budget), {"r": prompt}, GREEDY)["r"] for budget in (512, 37)
    ]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 24


def test_shared_prefix_is_served_from_the_cache_with_identical_output(loaded: LoadedModel) -> None:
    prefix = loaded.tokenizer.encode("Shared system prompt about foxes. " * 40)
    prefix = prefix[: -(len(prefix) % 16 + 5)]  # the two prompts part 5 tokens before a block ends
    assert len(prefix) >= 300
    first = [*prefix, *loaded.tokenizer.encode(" one, with words enough to fill the block where the two part")]
    second = [*prefix, *loaded.tokenizer.encode(" two")]
    cold = engine_for(loaded, enable_prefix_caching=False)
    expected = generate(cold, {"b": second}, GREEDY)["b"]
    engine = engine_for(loaded)
    generate(engine, {"a": first}, GREEDY)
    cached: list[int] = []
    engine.add_request("b", second, GREEDY)
    output: list[int] = []
    while engine.has_work():
        for step in engine.step():
            output.extend(step.new_token_ids)
            cached.append(step.num_cached_tokens)
    assert output == expected
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 300 and shared % 16  # whole blocks, then the shared tokens of the block where they part
    assert cached[0] == shared and engine.pool.hit_tokens == shared


def test_tiny_pool_preempts_and_still_gives_the_same_outputs(loaded: LoadedModel) -> None:
    work = prompts(loaded, 8, words=60)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    roomy = generate(engine_for(loaded), work, params)
    block_bytes = KVCache.bytes_per_block(2, 16, 2, 16, kv_cache_format("auto", loaded))  # layers, size, heads, dim
    tight = engine_for(loaded, kv_cache_memory=24 * block_bytes)  # 384 tokens for 8 x ~130
    preemptions = 0
    original = tight.scheduler._preempt

    def counting(seq: object) -> None:
        nonlocal preemptions
        preemptions += 1
        original(seq)

    tight.scheduler._preempt = counting
    assert generate(tight, work, params) == roomy
    assert preemptions > 0
    assert tight.pool.num_used_blocks == 0


def test_a_pinned_prefix_outlives_a_burst_and_gives_way_to_requests_that_need_its_blocks(loaded: LoadedModel) -> None:
    prefix = loaded.tokenizer.encode("Pinned system prompt about owls. " * 3)
    question = [*prefix, *loaded.tokenizer.encode(" one")]
    pinned_tokens = len(prefix) - len(prefix) % 16
    assert pinned_tokens >= 64
    expected = generate(engine_for(loaded, enable_prefix_caching=False), {"q": question}, GREEDY)["q"]
    block_bytes = KVCache.bytes_per_block(2, 16, 2, 16, kv_cache_format("auto", loaded))  # layers, size, heads, dim
    engine = engine_for(loaded, kv_cache_memory=24 * block_bytes, pinned_kv_fraction_per_key=0.5)
    pins = engine.pool.cache_pins
    generate(engine, {"first": question}, replace(GREEDY, cache_pins=(CachePinRequest(pinned_tokens, 300.0, "key"),)))
    assert pins.num_pinned_blocks == pinned_tokens // 16
    burst = prompts(loaded, 6, words=60)
    for request_id, prompt_ids in burst.items():  # one at a time: more blocks in all than the pool has
        generate(engine, {request_id: prompt_ids}, GREEDY)
    engine.add_request("again", question, GREEDY)
    again: list[int] = []
    cached = set()
    while engine.has_work():
        for step in engine.step():
            again.extend(step.new_token_ids)
            cached.add(step.num_cached_tokens)
    assert again == expected and cached == {pinned_tokens}
    assert pins.counters.released_under_pressure == 0 and pins.counters.hits == 1
    roomy = generate(engine_for(loaded), burst, GREEDY)
    assert generate(engine, burst, GREEDY) == roomy  # all at once: they need the pinned blocks too
    assert pins.counters.released_under_pressure == 1 and pins.num_pinned_blocks == 0
    assert engine.pool.num_used_blocks == 0


@pytest.fixture(scope="module", params=["qwen2", "gemma3"])
def invariance_model(
    request: pytest.FixtureRequest, loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> LoadedModel:
    """The Qwen2 model, and a Gemma 3 (a Llama variant: models/variants.py) of the same size."""
    if request.param == "qwen2":
        return loaded
    folder = make_tiny_model_dir(
        request.param, tmp_path_factory.mktemp(request.param), num_hidden_layers=2, layer_types=LAYER_TYPES
    )
    return load_model(str(folder), torch.device("cpu"), torch.float32)


@pytest.mark.invariance
def test_batched_equals_alone_for_greedy_and_seeded(invariance_model: LoadedModel) -> None:
    loaded = invariance_model
    work = prompts(loaded, 16, words=20)
    for params in (GREEDY, SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True)):
        engine = engine_for(loaded, enable_prefix_caching=False)
        together = generate(engine, work, params)
        alone = {rid: generate(engine, {rid: ids}, params)[rid] for rid, ids in work.items()}
        assert together == alone


def test_abort_frees_the_blocks(loaded: LoadedModel) -> None:
    engine = engine_for(loaded)
    engine.add_request("a", prompts(loaded, 1)["r0"], GREEDY)
    engine.step()
    assert engine.pool.num_used_blocks > 0
    assert engine.abort("a")
    assert engine.pool.num_used_blocks == 0 and not engine.has_work()


def test_a_failing_step_fails_only_its_requests_and_the_engine_goes_on(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_for(loaded)
    work = prompts(loaded, 2)
    engine.add_request("doomed", work["r0"], GREEDY)
    original = engine.runner.execute

    def failing(chunks: object) -> object:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine.runner, "execute", failing)
    outputs = engine.step()
    assert [(o.request_id, o.finished) for o in outputs] == [("doomed", True)]
    assert "injected failure" in outputs[0].error
    assert engine.pool.num_used_blocks == 0 and not engine.has_work()
    monkeypatch.setattr(engine.runner, "execute", original)
    assert generate(engine, {"r1": work["r1"]}, GREEDY) == generate(engine_for(loaded), {"r1": work["r1"]}, GREEDY)


def test_a_request_whose_sampling_fails_fails_alone_among_concurrent_ones(loaded: LoadedModel) -> None:
    engine = engine_for(loaded)
    work = prompts(loaded, 3)
    broken = replace(GREEDY, logit_bias={10**9: 1.0})  # a token id no vocabulary has: this request's sampling raises
    for request_id in ("r0", "r2"):
        engine.add_request(request_id, work[request_id], GREEDY)
    engine.add_request("r1", work["r1"], broken)
    outputs: dict[str, list[int]] = {"r0": [], "r2": []}
    errors: list[str] = []
    while engine.has_work():
        for step in engine.step():
            if step.error is not None:
                errors.append(step.request_id)
            else:
                outputs[step.request_id].extend(step.new_token_ids)
    assert errors == ["r1"]
    alone = generate(engine_for(loaded), {"r0": work["r0"], "r2": work["r2"]}, GREEDY)
    assert outputs == alone
    assert engine.pool.num_used_blocks == 0 and engine.failed_steps_in_a_row == 0


def test_an_engine_whose_forward_keeps_failing_is_degraded(loaded: LoadedModel) -> None:
    engine = engine_for(loaded)
    async_engine = AsyncEngine(engine, max_queue=8)
    try:
        assert not async_engine.is_degraded()
        engine.failed_steps_in_a_row = DEGRADED_AFTER_FAILED_STEPS
        assert async_engine.is_degraded()
        engine.failed_steps_in_a_row = 0
        assert not async_engine.is_degraded()
    finally:
        async_engine.shutdown()
    assert async_engine.is_degraded()  # the engine thread is gone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_generates_what_the_cpu_engine_does(qwen2_dir: Path, loaded: LoadedModel) -> None:
    on_gpu = load_model(str(qwen2_dir), torch.device("cuda"), torch.float32)
    work = prompts(loaded, 4)
    assert generate(engine_for(on_gpu), work, GREEDY) == generate(engine_for(loaded), work, GREEDY)


def test_a_request_short_of_blocks_waits_without_stepping_and_runs_once_a_session_lets_go(loaded: LoadedModel) -> None:
    engine = engine_for(loaded, kv_cache_memory=1 << 16, enable_prefix_caching=False)
    capacity = engine.pool.num_free_blocks * engine.pool.block_size
    encode = loaded.tokenizer.encode
    held = encode("A session that holds most of the pool. " * 200)[: capacity * 2 // 3]
    engine.add_request("turn", held, replace(GREEDY, max_tokens=2), session_id="s")
    generate_until_idle(engine)
    engine.commit_turn("turn", "s")
    generate_until_idle(engine)  # the refresh of its decoded tail
    prompt = encode("A request that needs more than what is left. " * 200)[: capacity // 2]
    assert len(prompt) + GREEDY.max_tokens <= engine.max_model_len
    async_engine = AsyncEngine(engine, max_queue=8)
    steps = 0
    step = engine.step

    def counted_step() -> list[RequestOutput]:
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted_step  # type: ignore[method-assign]

    async def run() -> list[int]:
        tokens: list[int] = []

        async def consume() -> None:
            async for output in async_engine.generate(EngineRequest("waits", prompt, GREEDY)):
                tokens.extend(output.new_token_ids)

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.5)
        assert not tokens and steps <= 2  # it waits for a command rather than trying again and again
        async_engine.release_session_kv("s")
        await consumer
        return tokens

    try:
        assert len(asyncio.run(run())) == GREEDY.max_tokens
    finally:
        async_engine.shutdown()


def test_a_priority_turn_does_not_overtake_the_refresh_its_session_waits_for(loaded: LoadedModel) -> None:
    engine = engine_for(loaded)
    encode = loaded.tokenizer.encode
    first = encode("The first turn of a session.")
    engine.add_request("first", first, GREEDY, session_id="s")
    generate_until_idle(engine)
    engine.commit_turn("first", "s")  # queues the refresh of its decoded tail
    second = first + [7] * (GREEDY.max_tokens - 1) + encode("And a turn in the priority tier.")
    engine.add_request("second", second, replace(GREEDY, priority=1), session_id="s")
    generate_until_idle(engine)
    engine.commit_turn("second", "s")
    assert engine.sessions.resident["s"].tokens[: len(second)] == second


def generate_until_idle(engine: Engine, max_steps: int = 1000) -> None:
    """Step a synchronous engine until its queues are empty (failing if they never empty)."""
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError(f"the engine still has work after {max_steps} steps")


def test_the_server_s_engine_thread_refreshes_a_reply_once_idle_for_a_while(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "REPLY_REFRESH_IDLE_S", 0.3)
    engine = engine_for(loaded)
    assert not engine.decoded_kv_exact  # a float model: its decoded K/V are not a prefill's
    async_engine = AsyncEngine(engine, max_queue=8)
    prompt = loaded.tokenizer.encode("A question about rivers. " * 8)
    params = replace(GREEDY, max_tokens=48)

    async def tokens_of(request: EngineRequest, cached: list[int]) -> list[int]:
        tokens = []
        async for output in async_engine.generate(request):
            tokens += output.new_token_ids
            cached.append(output.num_cached_tokens)
        return tokens

    async def run() -> tuple[list[int], list[int], bool]:
        reply = await tokens_of(EngineRequest("first", prompt, params), [])
        await asyncio.sleep(0.1)
        waited = engine.refreshing_reply is None and len(engine.reply_refreshes) == 1  # not idle long enough yet
        await asyncio.sleep(0.6)  # no command comes: the thread's timer starts the refresh
        cached: list[int] = []
        await tokens_of(EngineRequest("second", prompt + reply + prompt, replace(params, max_tokens=1)), cached)
        return reply, cached, waited

    try:
        reply, cached, waited = asyncio.run(run())
    finally:
        async_engine.shutdown()
    assert waited and cached[0] == (len(prompt) + len(reply)) // engine.pool.block_size * engine.pool.block_size
