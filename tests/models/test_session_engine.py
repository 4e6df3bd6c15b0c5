"""The default model as the server runs it: batch invariance, and exactness of session reuse and restore.

Each test runs in every KV cache format: the default (float16 for this float32 model), float32, bfloat16, q8_0, and
llama.cpp's arithmetic (int8 activations, float16 KV cache).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from statelm.config import EngineConfig
from statelm.engine import engine as engine_module
from statelm.engine.builder import create_engine, load_engine_model
from statelm.engine.engine import Engine
from statelm.engine.scheduler import ScheduledChunk
from statelm.engine.sequence import FinishReason, SamplingParams, Sequence
from statelm.models.loader import LoadedModel
from statelm.sessions.directory_store import DirectoryStore
from statelm.sessions.snapshot_format import SnapshotContent, read_snapshot, write_snapshot
from statelm.sessions.state_store import Area
from tests.models.engine_run import generate

pytestmark = [pytest.mark.invariance, pytest.mark.slow]


SETTINGS = {
    "default": {},
    "float32-kv": {"kv_cache_dtype": "float32"},
    "bfloat16-kv": {"kv_cache_dtype": "bfloat16"},
    "q8_0-kv": {"kv_cache_dtype": "q8_0"},
    "int8-fp16kv": {"activations": "int8", "kv_cache_dtype": "float16"},
}


@pytest.fixture(scope="module", params=list(SETTINGS))
def settings(request: pytest.FixtureRequest) -> dict[str, str]:
    return SETTINGS[request.param]


@pytest.fixture(scope="module")
def loaded(settings: dict[str, str]) -> LoadedModel:
    return load_engine_model(EngineConfig(**settings))


@pytest.fixture
def engine(loaded: LoadedModel, settings: dict[str, str]) -> Engine:
    return create_engine(loaded, EngineConfig(kv_cache_memory=64 << 20, **settings))


def chat_prompt(loaded: LoadedModel, text: str) -> list[int]:
    tokenizer = loaded.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def run_until_idle(engine: Engine, until_requests_end: bool = False) -> list[int]:
    """Step until no work is left (or, until_requests_end, none but a reply's refresh); returns the tokens generated."""
    generated: list[int] = []
    while engine.scheduler.has_work() if until_requests_end else engine.has_work():
        for output in engine.step():
            assert output.error is None
            generated += output.new_token_ids
    return generated


def run_turn(
    engine: Engine, session_id: str, prompt: list[int], max_tokens: int, cached: int | None = None
) -> list[int]:
    """One greedy session turn, committed, and the refresh of its decoded tail where one is due (not where generated
    rows compute as prompt rows do: int8 activations); returns the generated tokens.

    cached: the prompt tokens the turn must find in the session's KV (unchecked if None).
    """
    request_id = f"{session_id}-{len(prompt)}"
    engine.add_request(request_id, prompt, SamplingParams(0.0, max_tokens=max_tokens, ignore_eos=True), session_id)
    generated: list[int] = []
    while engine.has_work():
        for output in engine.step():
            assert output.error is None
            generated += output.new_token_ids
            if output.request_id == request_id and cached is not None:
                assert output.num_cached_tokens == cached
    computed = len(prompt) + len(generated) - 1
    assert engine.commit_turn(request_id, session_id) == computed
    exact = engine.sessions.resident[session_id].exact
    assert exact == (computed if engine.decoded_kv_exact else len(prompt))
    assert engine.has_work() is (exact < computed)  # the refresh
    exported: list[int] = []  # the tokens of an export that waits for the refresh (as a snapshot's and a save's do)
    engine.sessions.after_refresh(session_id, lambda: exported.append(len(engine.sessions.export(session_id).tokens)))
    assert exported == ([] if exact < computed else [computed])
    assert run_until_idle(engine) == []
    assert engine.sessions.resident[session_id].exact == computed
    assert exported == [computed]
    return generated


def test_generated_rows_compute_as_prompt_rows_with_one_arithmetic(engine: Engine, settings: dict[str, str]) -> None:
    assert engine.decoded_kv_exact is (settings.get("activations") == "int8")  # the default model: int16-prompt


def next_token_logits(engine: Engine, session_id: str, prompt: list[int]) -> torch.Tensor:
    """Logits after prompt, computed from the session's KV (attached by LCP), without sampling."""
    seq = Sequence("probe", prompt, SamplingParams(0.0), frozenset(), 4096, session_id=session_id)
    attached = engine.sessions.attach(seq, engine.sessions.reusable_length(seq))
    assert attached == len(engine.sessions.resident[session_id].tokens)
    assert engine.kv.grow(seq.block_table, seq.num_tokens)
    logits = engine.runner.execute([ScheduledChunk(seq, seq.num_uncomputed_tokens)]).logits
    engine.kv.free(seq.block_table)
    return logits


def test_session_kv_equals_a_prefill_of_the_same_tokens(loaded: LoadedModel, engine: Engine) -> None:
    prompt = chat_prompt(loaded, "Tell me a story about a dragon.")
    generated = run_turn(engine, "decoded", prompt, 150)
    run_turn(engine, "prefilled", prompt + generated, 1)
    decoded, prefilled = engine.sessions.export("decoded"), engine.sessions.export("prefilled")
    assert decoded is not None and prefilled is not None
    count = len(decoded.tokens)
    assert prefilled.tokens[:count] == decoded.tokens
    for ours, theirs in zip(decoded.keys + decoded.values, prefilled.keys + prefilled.values, strict=True):
        assert torch.equal(ours, theirs[:count])


def test_a_session_turn_equals_the_stateless_request(
    loaded: LoadedModel, engine: Engine, settings: dict[str, str]
) -> None:
    first = chat_prompt(loaded, "Name three rivers of Europe.")
    generated = run_turn(engine, "chat", first, 24)
    second = (
        first
        + generated
        + loaded.tokenizer.encode(
            "<|im_end|>\n<|im_start|>user\nWhich of them is the longest?<|im_end|>\n<|im_start|>assistant\n"
        )
    )
    turn = run_turn(engine, "chat", second, 16, cached=len(first) + len(generated) - 1)
    fresh = create_engine(loaded, EngineConfig(kv_cache_memory=16 << 20, enable_prefix_caching=False, **settings))
    stateless = generate(fresh, {"stateless": second}, SamplingParams(0.0, max_tokens=16, ignore_eos=True))
    assert turn == stateless["stateless"]


def one_per_arithmetic(settings: dict[str, str]) -> None:
    """Skip the KV formats' settings: what is tested depends on the arithmetic of the rows alone."""
    if settings not in (SETTINGS["default"], SETTINGS["int8-fp16kv"]):
        pytest.skip("the same arithmetic as the default's")


def test_a_stateless_follow_up_finds_the_reply_cached(
    loaded: LoadedModel, engine: Engine, settings: dict[str, str]
) -> None:
    one_per_arithmetic(settings)
    params = SamplingParams(0.0, max_tokens=40, ignore_eos=True)
    first = chat_prompt(loaded, "Name three rivers of Europe.")
    engine.add_request("first", first, params)
    reply = run_until_idle(engine, until_requests_end=True)
    # the reply's K/V: published as decoded where exact, else computed again as prompt rows while the engine idles
    assert bool(engine.reply_refreshes) is not engine.decoded_kv_exact
    run_until_idle(engine)
    second = first + reply + loaded.tokenizer.encode("<|im_end|>\n<|im_start|>user\nThe longest?<|im_end|>\n")
    engine.add_request("second", second, params)
    cached, output = [], []
    while engine.has_work():
        for step in engine.step():
            cached.append(step.num_cached_tokens)
            output += step.new_token_ids
    computed = len(first) + len(reply) - (1 if engine.decoded_kv_exact else 0)  # decoded: not the last token's K/V
    assert cached[0] == computed // 16 * 16  # the full blocks published
    fresh = create_engine(loaded, EngineConfig(kv_cache_memory=16 << 20, enable_prefix_caching=False, **settings))
    assert output == generate(fresh, {"stateless": second}, params)["stateless"]


def test_a_reply_refresh_waits_for_idle_time_and_a_waiting_request_stops_it(
    loaded: LoadedModel, settings: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    one_per_arithmetic(settings)
    engine = create_engine(loaded, EngineConfig(kv_cache_memory=64 << 20, max_num_batched_tokens=64, **settings))
    if engine.decoded_kv_exact:
        pytest.skip("decoded K/V are a prefill's: no reply is refreshed")
    monkeypatch.setattr(engine_module, "REPLY_REFRESH_IDLE_S", 10.0)  # as the server has it, if longer
    engine.add_request(
        "long", chat_prompt(loaded, "Tell me a story."), SamplingParams(0.0, max_tokens=100, ignore_eos=True)
    )
    run_until_idle(engine, until_requests_end=True)
    engine.step()
    assert engine.refreshing_reply is None and 0 < engine.seconds_to_idle_work() <= 10.0
    engine.idle_since -= 10.0  # idle that long: no request came at once
    # the idle engine starts prefilling the reply, a step as long as IDLE_STEP_S at the prompt rows' rate
    engine.prompt_row_seconds = engine_module.IDLE_STEP_S / 20  # one block in time: the least
    engine.step()
    refresh = engine.refreshing_reply
    assert refresh is not None and refresh.num_computed_tokens == refresh.num_cached_prompt_tokens + 16
    engine.prompt_row_seconds = engine_module.IDLE_STEP_S / 40  # two blocks, within the step budget (64 rows)
    engine.step()
    assert refresh.num_computed_tokens == refresh.num_cached_prompt_tokens + 48 and refresh.num_uncomputed_tokens
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.refreshing) == (0, 0, 1)  # no request's: /metrics counts it apart
    prompt, params = chat_prompt(loaded, "What is two plus two?"), SamplingParams(0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("next", prompt, params)
    tokens = [token for output in engine.step() for token in output.new_token_ids]
    assert refresh.finish_reason is FinishReason.ABORT and engine.refreshing_reply is None  # the request went first
    assert tokens and not engine.reply_refreshes
    fresh = create_engine(loaded, EngineConfig(kv_cache_memory=16 << 20, enable_prefix_caching=False, **settings))
    assert tokens + run_until_idle(engine, until_requests_end=True) == generate(fresh, {"next": prompt}, params)["next"]


def test_no_refresh_replies_queues_none(loaded: LoadedModel, settings: dict[str, str]) -> None:
    one_per_arithmetic(settings)
    engine = create_engine(loaded, EngineConfig(kv_cache_memory=64 << 20, refresh_replies=False, **settings))
    engine.add_request("r", chat_prompt(loaded, "Count to ten."), SamplingParams(0.0, max_tokens=40, ignore_eos=True))
    run_until_idle(engine, until_requests_end=True)
    assert not engine.reply_refreshes and not engine.has_work()


def test_snapshot_restore_gives_identical_next_token_logits(
    loaded: LoadedModel, engine: Engine, tmp_path: Path
) -> None:
    prompt = chat_prompt(loaded, "What is the capital of France?")
    generated = run_turn(engine, "original", prompt, 20)
    data = engine.sessions.export("original")
    assert data is not None
    manifest = {"model": {"name": loaded.name, "fingerprint": loaded.fingerprint.parts}}
    store = DirectoryStore(tmp_path)
    write_snapshot(store, Area.SNAPSHOTS, "snap", manifest, SnapshotContent([{"role": "user", "content": "hi"}], data))
    _, content = read_snapshot(store, Area.SNAPSHOTS, "snap", loaded.fingerprint)
    engine.sessions.load("restored", content.kv)
    follow_up = prompt + generated + loaded.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd Germany?<|im_end|>\n")
    original = next_token_logits(engine, "original", follow_up)
    restored = next_token_logits(engine, "restored", follow_up)
    assert torch.equal(original, restored)


def test_sixteen_concurrent_greedy_requests_equal_each_alone(
    loaded: LoadedModel, engine: Engine, settings: dict[str, str]
) -> None:
    questions = [f"Question {i}: what is {i} plus {i * 7}? " + "Think step by step. " * (i % 5) for i in range(16)]
    prompts = {f"r{i}": chat_prompt(loaded, text) for i, text in enumerate(questions)}
    params = SamplingParams(0.0, max_tokens=10, ignore_eos=True)
    together = generate(engine, prompts, params)
    for request_id, prompt in list(prompts.items())[::5]:  # a fresh engine each: no KV shared with the batch
        fresh = create_engine(loaded, EngineConfig(kv_cache_memory=16 << 20, enable_prefix_caching=False, **settings))
        alone = generate(fresh, {request_id: prompt}, params)
        assert alone[request_id] == together[request_id], request_id
