"""Drafts by prompt lookup, verified in one forward, give exactly the tokens and logprobs of decoding one at a time."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from statelm.config import EngineConfig
from statelm.engine import engine as engine_module
from statelm.engine.builder import create_engine, load_engine_model
from statelm.engine.engine import Engine
from statelm.engine.grammar import GrammarBackend
from statelm.engine.sampler import TokenLogprob
from statelm.engine.sequence import SamplingParams
from statelm.models.loader import LoadedModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PARAMS = {
    "greedy": GREEDY,
    "seeded": SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True, logprobs=3),
    "penalties": replace(GREEDY, repetition_penalty=1.2, presence_penalty=0.3, logprobs=1),
    "stops": replace(GREEDY, ignore_eos=False, min_tokens=3, stop_token_ids=frozenset({5, 9})),
}
Reply = tuple[list[int], list[TokenLogprob]]


@pytest.fixture(scope="module")
def loaded(qwen2_dir: Path) -> LoadedModel:
    """The tiny model as the server loads it: batch-invariant rows, its compute path from the self-check."""
    loaded = load_engine_model(EngineConfig(model=str(qwen2_dir)))
    create_engine(loaded, EngineConfig(kv_cache_memory=8 << 20))  # runs the self-check
    return loaded


def engine_for(loaded: LoadedModel, draft_tokens: int, **settings: object) -> Engine:
    config = EngineConfig(kv_cache_memory=8 << 20, speculative_tokens=draft_tokens, **settings)  # type: ignore[arg-type]
    return create_engine(loaded, config)


def run(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[tuple[str, int], Reply]:
    """Every choice's tokens and logprobs, all prompts run together."""
    replies: dict[tuple[str, int], Reply] = {}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_work():
        for output in engine.step():
            assert output.error is None, output.error
            tokens, logprobs = replies.setdefault((output.request_id, output.index), ([], []))
            tokens.extend(output.new_token_ids)
            logprobs.extend(output.logprobs or [])
    return replies


def repetitive(loaded: LoadedModel, count: int) -> dict[str, list[int]]:
    """Prompts on which the tiny model's greedy reply soon repeats a pair of tokens over and over."""
    encode = loaded.tokenizer.encode
    return {f"r{i}": encode(f"{i} " + "a b c d e f g " * 8) for i in range(count)}


@pytest.mark.parametrize("name", PARAMS)
def test_drafts_give_the_tokens_and_logprobs_of_one_at_a_time(loaded: LoadedModel, name: str) -> None:
    params = PARAMS[name]
    prompts = repetitive(loaded, 1)
    plain = engine_for(loaded, 0)
    expected = run(plain, prompts, params)
    assert plain.stats().draft_tokens == 0
    engine = engine_for(loaded, 4)
    assert run(engine, prompts, params) == expected
    assert engine.pool.num_used_blocks == 0  # blocks grown for draft rows that were not taken went back
    if name == "greedy":  # the tiny model's greedy reply repeats itself: its drafts are taken
        assert engine.stats().draft_tokens_accepted >= 10


def test_several_sequences_and_choices_draft_each_their_own(loaded: LoadedModel) -> None:
    prompts = repetitive(loaded, 2)
    params = replace(PARAMS["seeded"], temperature=0.1, n=2)  # near greedy: drafts taken in part
    engine = engine_for(loaded, 3)
    assert run(engine, prompts, params) == run(engine_for(loaded, 0), prompts, params)
    stats = engine.stats()
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens


def test_no_drafts_while_more_sequences_run_than_speculation_serves(loaded: LoadedModel) -> None:
    prompts = repetitive(loaded, engine_module.SPECULATION_MAX_RUNNING + 1)
    params = replace(GREEDY, max_tokens=12)
    engine = engine_for(loaded, 4)
    assert run(engine, prompts, params) == run(engine_for(loaded, 0), prompts, params)
    assert engine.stats().draft_tokens == 0
    assert run(engine, {"alone": prompts["r0"]}, params)["alone", 0] == run(engine, prompts, params)["r0", 0]
    assert engine.stats().draft_tokens > 0  # alone, it drafts


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_a_draft_never_runs_past_max_tokens(loaded: LoadedModel, max_tokens: int) -> None:
    prompts = repetitive(loaded, 1)
    params = replace(GREEDY, max_tokens=max_tokens)
    replies = run(engine_for(loaded, 4), prompts, params)
    assert replies == run(engine_for(loaded, 0), prompts, params)
    assert len(replies["r0", 0][0]) == max_tokens


def test_a_draft_never_runs_past_the_context(loaded: LoadedModel) -> None:
    prompts = repetitive(loaded, 1)
    length = len(prompts["r0"]) + 9
    replies = run(engine_for(loaded, 4, max_model_len=length), prompts, replace(GREEDY, max_tokens=100))
    assert len(prompts["r0"]) + len(replies["r0", 0][0]) == length


def test_the_default_drafts_on_a_verified_cpu_path_and_zero_turns_it_off(loaded: LoadedModel) -> None:
    assert loaded.invariance is not None and loaded.invariance.verified
    assert create_engine(loaded, EngineConfig(kv_cache_memory=8 << 20)).speculative_tokens == 4
    assert engine_for(loaded, 0).speculative_tokens == 0


@pytest.mark.parametrize(("kind", "spec"), [("regex", "(ab ){12}x"), ("json_object", None)])
def test_drafts_under_a_grammar_give_its_output_unchanged(loaded: LoadedModel, kind: str, spec: str | None) -> None:
    grammar = GrammarBackend(loaded.tokenizer).compile(kind, spec)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=48, grammar=grammar, logprobs=1)
    prompts = repetitive(loaded, 1)
    engine = engine_for(loaded, 4)
    assert run(engine, prompts, params) == run(engine_for(loaded, 0), prompts, params)
    if kind == "regex":  # the grammar repeats itself: drafts are taken
        assert engine.stats().draft_tokens_accepted >= 10


def test_the_default_model_quoting_its_prompt_takes_drafts_and_replies_the_same() -> None:
    """The real bundled model, as the server loads it, asked to repeat a sentence: most of the reply comes from drafts,
    and it is the reply of one token a step."""
    loaded = load_engine_model(EngineConfig())
    sentence = "The paged KV cache keeps every block of a session resident between turns, so a follow-up is cheap."
    messages = [{"role": "user", "content": f"Repeat this sentence exactly: {sentence}"}]
    prompt = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    params = replace(GREEDY, ignore_eos=False, max_tokens=60)
    engine = engine_for(loaded, 4)
    reply = run(engine, {"r": prompt}, params)
    assert reply == run(engine_for(loaded, 0), {"r": prompt}, params)
    assert sentence in loaded.tokenizer.decode(reply["r", 0][0])
    assert engine.stats().draft_tokens_accepted >= len(reply["r", 0][0]) // 2
