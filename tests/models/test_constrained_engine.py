"""Guided generation on a tiny real model: grammars hold, reasoning budgets are forced, loops stop, others unchanged."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from statelm.config import EngineConfig
from statelm.engine.builder import create_engine
from statelm.engine.client import RequestOutput
from statelm.engine.engine import Engine
from statelm.engine.grammar import GrammarBackend
from statelm.engine.guidance import ReasoningBudget
from statelm.engine.repetition import RepetitionConfig
from statelm.engine.sequence import FinishReason, SamplingParams
from statelm.models.loader import LoadedModel, load_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@dataclasses.dataclass
class Choice:
    """One choice's generated tokens and its last step output."""

    tokens: list[int]
    last: RequestOutput | None = None


@pytest.fixture(scope="module")
def loaded(qwen2_dir: Path) -> LoadedModel:
    return load_model(str(qwen2_dir), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def backend(loaded: LoadedModel) -> GrammarBackend:
    return GrammarBackend(loaded.tokenizer)


def engine_for(loaded: LoadedModel) -> Engine:
    return create_engine(loaded, EngineConfig(kv_cache_memory=8 << 20))


def run(loaded: LoadedModel, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[tuple[str, int], Choice]:
    """Run the requests together in one engine; each (request id, choice index)'s tokens and last output."""
    engine = engine_for(loaded)
    choices: dict[tuple[str, int], Choice] = {}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_work():
        for output in engine.step():
            assert output.error is None, output.error
            choice = choices.setdefault((output.request_id, output.index), Choice([]))
            choice.tokens += output.new_token_ids
            choice.last = output
    assert engine.pool.num_used_blocks == 0
    return choices


def text_of(loaded: LoadedModel, choice: Choice) -> str:
    """The choice's output text: without its last token if that token ended it (EOS)."""
    assert choice.last is not None and choice.last.finished
    tokens = choice.tokens[:-1] if choice.last.ended_by_token else choice.tokens
    return loaded.tokenizer.decode(tokens)


def prompt(loaded: LoadedModel) -> list[int]:
    return loaded.tokenizer.encode("The quick brown fox")


def test_json_schema_output_is_valid_and_ends_by_itself(loaded: LoadedModel, backend: GrammarBackend) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=150, grammar=backend.compile("json_schema", SCHEMA))
    requests = {f"s{seed}": (prompt(loaded), dataclasses.replace(params, seed=seed)) for seed in range(4)}
    for choice in run(loaded, requests).values():
        assert choice.last is not None and choice.last.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(text_of(loaded, choice)), SCHEMA)


def test_n_choices_each_follow_the_grammar(loaded: LoadedModel, backend: GrammarBackend) -> None:
    params = SamplingParams(
        temperature=1.0, seed=11, n=3, max_tokens=150, grammar=backend.compile("json_schema", SCHEMA)
    )
    choices = run(loaded, {"r": (prompt(loaded), params)})
    assert sorted(index for _, index in choices) == [0, 1, 2]
    texts = [text_of(loaded, choice) for choice in choices.values()]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) == 3


def test_regex_output_matches_exactly(loaded: LoadedModel, backend: GrammarBackend) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=20, grammar=backend.compile("regex", "[a-c]{3}x"))
    requests = {f"s{seed}": (prompt(loaded), dataclasses.replace(params, seed=seed)) for seed in range(3)}
    for choice in run(loaded, requests).values():
        assert choice.last is not None and choice.last.finish_reason is FinishReason.STOP
        assert not choice.last.ended_by_token
        assert re.fullmatch("[a-c]{3}x", text_of(loaded, choice))


def test_reasoning_budget_forces_the_end_tag_and_the_grammar_starts_after_it(
    loaded: LoadedModel, backend: GrammarBackend
) -> None:
    encode = loaded.tokenizer.encode
    start, end = tuple(encode(" quick")), tuple(encode(" brown fox"))
    budget = ReasoningBudget(5, start, end, opened_by_prompt=True)
    free = SamplingParams(temperature=1.0, seed=3, ignore_eos=True, max_tokens=20, reasoning=budget)
    answer = re.compile("[a-c]{3}x")
    guided = dataclasses.replace(free, grammar=backend.compile("regex", answer.pattern), grammar_start_after=end)
    choices = run(loaded, {"free": (prompt(loaded), free), "guided": (prompt(loaded), guided)})
    thought, answered = choices["free", 0], choices["guided", 0]
    assert len(thought.tokens) == 20 and thought.tokens[5:7] == list(end)
    assert answered.tokens[:7] == thought.tokens[:7]  # the grammar waits for the end tag
    assert answered.last is not None and answered.last.finish_reason is FinishReason.STOP
    assert answer.fullmatch(loaded.tokenizer.decode(answered.tokens[7:]))


def test_a_loop_stops_generation_early(loaded: LoadedModel, backend: GrammarBackend) -> None:
    config = RepetitionConfig(min_period=1, max_period=8, min_repeats=3, min_tokens=8)
    hash_id, at_id = loaded.tokenizer.encode("#@")
    dominated = SamplingParams(temperature=1.0, seed=1, max_tokens=60, logit_bias={hash_id: 100.0}, repetition=config)
    alternating = SamplingParams(
        temperature=1.0, seed=1, max_tokens=60, grammar=backend.compile("regex", "(#@){50}"), repetition=config
    )
    choices = run(loaded, {"one": (prompt(loaded), dominated), "two": (prompt(loaded), alternating)})
    for request_id, period in (("one", 1), ("two", 2)):
        choice = choices[request_id, 0]
        assert choice.last is not None and choice.last.repetition_detected
        assert choice.last.finish_reason is FinishReason.STOP and not choice.last.ended_by_token
        assert 8 <= len(choice.tokens) <= 8 + 2 * period
    assert set(choices["two", 0].tokens) == {hash_id, at_id}


def test_unguided_rows_sample_as_they_would_alone(loaded: LoadedModel, backend: GrammarBackend) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = run(loaded, {"plain": (prompt(loaded), greedy)})["plain", 0].tokens
    lazy = loaded.tokenizer.encode(" lazy")
    budget = ReasoningBudget(2, (), tuple(lazy), opened_by_prompt=True)
    json_object = dataclasses.replace(greedy, max_tokens=30, grammar=backend.compile("json_object"))
    requests = {
        "json": (prompt(loaded), json_object),
        "plain": (prompt(loaded), greedy),
        "forced": (prompt(loaded), dataclasses.replace(greedy, reasoning=budget)),
    }
    together = run(loaded, requests)
    assert together["plain", 0].tokens == alone
    assert together["forced", 0].tokens[2:3] == lazy
    assert loaded.tokenizer.decode(together["json", 0].tokens).lstrip().startswith("{")
