"""n choices on a tiny real model: one prefill shared by all, each choice reproducible alone; failures stay put."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from statelm.config import EngineConfig
from statelm.engine.builder import create_engine
from statelm.engine.engine import Engine
from statelm.engine.sequence import SamplingParams
from statelm.models.loader import LoadedModel, load_model
from tests.models.engine_run import generate


@pytest.fixture(scope="module")
def loaded(qwen2_dir: Path) -> LoadedModel:
    return load_model(str(qwen2_dir), torch.device("cpu"), torch.float32)


def engine_for(loaded: LoadedModel) -> Engine:
    return create_engine(loaded, EngineConfig(kv_cache_memory=8 << 20))


def test_choices_share_the_prompt_and_equal_single_requests_with_consecutive_seeds(loaded: LoadedModel) -> None:
    prompt = loaded.tokenizer.encode("A story about a fox and a crow, " * 6)
    full_blocks = len(prompt) // 16
    assert len(prompt) % 16 and full_blocks >= 2
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=10, ignore_eos=True, logprobs=1)
    engine = engine_for(loaded)
    engine.add_request("r", prompt, params)
    first_step = engine.step()
    assert [output.index for output in first_step] == [0, 1, 2]
    parent, forks = engine.scheduler.running[0], list(engine.scheduler.waiting)
    assert [fork.index for fork in forks] == [1, 2]
    for fork in forks:  # the prompt was computed once: full blocks shared, the partial one copied
        assert fork.num_computed_tokens == len(prompt)
        assert fork.block_table.blocks[:full_blocks] == parent.block_table.blocks[:full_blocks]
        assert fork.block_table.blocks[full_blocks] != parent.block_table.blocks[full_blocks]
    choices: dict[int, list[int]] = {index: [] for index in range(3)}
    for output in first_step:
        choices[output.index] += output.new_token_ids
    while engine.has_work():
        for output in engine.step():
            assert output.error is None and output.logprobs is not None
            choices[output.index] += output.new_token_ids
    singles = [
        generate(engine_for(loaded), {"s": prompt}, dataclasses.replace(params, n=1, seed=7 + index))["s"]
        for index in range(3)
    ]
    assert [choices[index] for index in range(3)] == singles
    assert len({tuple(single) for single in singles}) > 1
    assert engine.pool.num_used_blocks == 0


def test_choices_that_end_at_their_first_token_free_everything(loaded: LoadedModel) -> None:
    engine = engine_for(loaded)
    engine.add_request("r", loaded.tokenizer.encode("Hello there, " * 10), SamplingParams(n=4, max_tokens=1))
    outputs = engine.step()
    assert sorted(output.index for output in outputs) == [0, 1, 2, 3] and all(o.finished for o in outputs)
    assert not engine.has_work() and engine.pool.num_used_blocks == 0


def test_a_request_that_fails_to_sample_fails_alone(loaded: LoadedModel) -> None:
    prompt = loaded.tokenizer.encode("The weather today is")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = generate(engine_for(loaded), {"good": prompt}, greedy)["good"]
    engine = engine_for(loaded)
    engine.add_request("bad", prompt, SamplingParams(logit_bias={10**7: 1.0}, n=2))
    engine.add_request("good", prompt, greedy)
    good: list[int] = []
    errors = []
    while engine.has_work():
        for output in engine.step():
            if output.error is not None:
                errors.append(output.request_id)
            else:
                good += output.new_token_ids
    assert errors == ["bad"] and good == expected
    assert engine.pool.num_used_blocks == 0
