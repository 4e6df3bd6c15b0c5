"""The default SmolLM2 GGUF: statelm's greedy output equals transformers' loading the same file."""

from __future__ import annotations

import functools

import gguf
import pytest
import torch

from statelm.config import EngineConfig
from statelm.engine.builder import create_engine, load_engine_model
from statelm.engine.engine import Engine
from statelm.engine.sequence import SamplingParams
from statelm.models.loader import LoadedModel, load_model, resolve_source
from tests.models.engine_run import generate

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in one paragraph why the sky is blue.",
]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def statelm_model() -> LoadedModel:
    return load_model("default", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def prompt_ids(statelm_model: LoadedModel) -> dict[str, list[int]]:
    tokenizer = statelm_model.tokenizer
    return {
        f"p{i}": tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        for i, text in enumerate(PROMPTS)
    }


@pytest.fixture(scope="module")
def transformers_greedy(prompt_ids: dict[str, list[int]]) -> dict[str, list[int]]:
    transformers = pytest.importorskip("transformers")
    source = resolve_source("default")
    with pytest.MonkeyPatch.context() as patch:
        # transformers rebuilds gguf's (pure) tensor name map once per tensor (~6 s of the load) and parses the file
        # twice, for the config and for the weights (~4 s each): both made once here
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source.path.parent, gguf_file=source.path.name, dtype=torch.float32
        )
    results = {}
    for request_id, ids in prompt_ids.items():
        output = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=2
        )
        results[request_id] = output[0, len(ids) :].tolist()
    return results


@pytest.fixture(scope="module")
def engine(statelm_model: LoadedModel) -> Engine:
    return create_engine(statelm_model, EngineConfig(kv_cache_memory=64 << 20))


@pytest.fixture(scope="module")
def batched(engine: Engine, prompt_ids: dict[str, list[int]]) -> dict[str, list[int]]:
    """statelm's greedy output for every prompt, all in one batch (made once for both tests)."""
    return generate(engine, prompt_ids, GREEDY)


def test_greedy_output_matches_transformers(
    engine: Engine, batched: dict[str, list[int]], transformers_greedy: dict[str, list[int]]
) -> None:
    assert batched == transformers_greedy
    assert any(len(tokens) == NEW_TOKENS for tokens in batched.values())
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_batched_and_alone_agree(
    engine: Engine, prompt_ids: dict[str, list[int]], batched: dict[str, list[int]]
) -> None:
    alone = {rid: generate(engine, {rid: ids}, GREEDY)[rid] for rid, ids in prompt_ids.items()}
    assert batched == alone


def test_the_tied_embedding_looks_up_the_head_s_interleaved_copy() -> None:
    """SmolLM2 ties its LM head to the embedding: packed, the head reads an interleaved copy (the file's pages
    handed back) and the lookups read that copy too (tests/unit/test_mapped_pages.py)."""
    config = EngineConfig(kv_cache_memory=8 << 20)
    model = create_engine(load_engine_model(config), config).runner.model
    assert model.compute_path == "kernels" and model.packed_head is not None
    assert model.embed_tokens.weight is model.packed_head.weight and model.packed_head.weight.interleaved
