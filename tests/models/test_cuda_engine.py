"""The engine on a CUDA device: Triton attention, CUDA graphs of decode steps, batch invariance (GPU only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from statelm.config import EngineConfig
from statelm.engine.builder import create_engine, load_engine_model
from statelm.engine.engine import Engine
from statelm.engine.sequence import SamplingParams
from statelm.models.loader import LoadedModel
from tests.models.engine_run import generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(qwen2_dir: Path) -> LoadedModel:
    return load_engine_model(EngineConfig(model=str(qwen2_dir), device="cuda", dtype="bfloat16"))


def engine_for(loaded: LoadedModel, **settings: object) -> Engine:
    return create_engine(loaded, EngineConfig(**{"kv_cache_memory": 64 << 20, "max_num_seqs": 32, **settings}))


def prompts(loaded: LoadedModel, count: int) -> dict[str, list[int]]:
    encode = loaded.tokenizer.encode
    return {f"r{i}": encode(f"Request {i}: " + "the quick brown fox " * (3 + 5 * i)) for i in range(count)}


def test_the_compute_path_is_triton_and_verified_batch_invariant(loaded: LoadedModel) -> None:
    engine_for(loaded)
    report = loaded.invariance
    assert report is not None and report.path == "triton" and report.verified, report and report.summary()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_graph_replays_equal_eager_steps(loaded: LoadedModel, params: SamplingParams) -> None:
    graphed = engine_for(loaded)
    assert graphed.runner.graphs is not None
    replays = 0
    replay = graphed.runner.graphs.replay

    def counted(*args: object) -> torch.Tensor:
        nonlocal replays
        replays += 1
        return replay(*args)  # type: ignore[arg-type]

    graphed.runner.graphs.replay = counted  # type: ignore[method-assign]
    requests = prompts(loaded, 5)
    with_graphs = generate(graphed, requests, params)
    assert replays >= params.max_tokens - 2  # decode steps replayed a graph
    eager = engine_for(loaded, enforce_eager=True)
    assert eager.runner.graphs is None
    assert generate(eager, requests, params) == with_graphs


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_sixteen_concurrent_requests_equal_each_alone(loaded: LoadedModel, params: SamplingParams) -> None:
    requests = prompts(loaded, 16)
    together = generate(engine_for(loaded), requests, params)
    for request_id, prompt_ids in requests.items():
        alone = generate(engine_for(loaded), {request_id: prompt_ids}, params)
        assert alone[request_id] == together[request_id], request_id


def test_session_kv_restored_from_a_spill_continues_exactly(loaded: LoadedModel) -> None:
    engine = engine_for(loaded)
    prompt = prompts(loaded, 1)["r0"]
    expected = generate(engine_for(loaded), {"r": prompt}, GREEDY)["r"]
    engine.add_request("turn", prompt[:20], SamplingParams(temperature=0.0, max_tokens=1), session_id="s")
    while engine.has_work():
        engine.step()
    engine.commit_turn("turn", "s")
    while engine.has_work():
        engine.step()
    data = engine.sessions.export("s")
    assert data is not None
    engine.sessions.release("s")
    restored = engine_for(loaded)
    restored.add_request("next", prompt, GREEDY, session_id="s", restore=data)
    output: list[int] = []
    while restored.has_work():
        for step in restored.step():
            output.extend(step.new_token_ids)
    assert output == expected


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafts_asked_for_on_a_gpu_give_the_replies_of_graph_replayed_steps(
    loaded: LoadedModel, params: SamplingParams
) -> None:
    """Off by default on a GPU; asked for, a draft's rows run eagerly beside the graph-replayed steps of others."""
    assert engine_for(loaded).speculative_tokens == 0
    requests = {"r": loaded.tokenizer.encode("0 " + "a b c d e f g " * 8)}
    drafting = engine_for(loaded, speculative_tokens=4)
    assert generate(drafting, requests, params) == generate(engine_for(loaded), requests, params)
