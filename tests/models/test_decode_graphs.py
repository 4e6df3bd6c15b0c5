"""Decode steps through DecodeGraphs' persistent buffers equal eager steps: buckets, padding rows, inputs.

A CUDA graph cannot be captured on the CPU, so these tests record each bucket as an eager replay of the same
forward over the same buffers (the only part a real capture adds is the graph itself, tested on a GPU by
tests/models/test_cuda_engine.py). Attention is the Triton backend, which reads the buffers' tensors only, run
by Triton's interpreter.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from statelm.config import EngineConfig
from statelm.engine.builder import create_engine
from statelm.engine.cuda_graphs import DecodeGraphs, batch_buckets, context_bound
from statelm.engine.engine import Engine
from statelm.engine.sequence import SamplingParams
from statelm.models.compute_path import use_compute_path
from statelm.models.invariance import InvarianceReport
from statelm.models.layers import RowChunking
from statelm.models.loader import LoadedModel, load_model
from tests.models.engine_run import generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class EagerReplays(DecodeGraphs):
    """DecodeGraphs whose buckets replay by running the forward again over the same buffers."""

    def _record(self, size: int) -> tuple[Callable[[], None], torch.Tensor]:
        out = self.forward(*self._inputs(size))

        def replay() -> None:
            out.copy_(self.forward(*self._inputs(size)))

        return replay, out


@pytest.fixture(scope="module")
def loaded(qwen2_dir: Path) -> LoadedModel:
    model = load_model(str(qwen2_dir), torch.device("cpu"), torch.float32, chunking=RowChunking.batch_invariant())
    use_compute_path(model.model, "triton")
    model.invariance = InvarianceReport(path="triton", verified=False, cpu="test: Triton's interpreter")
    return model


def engine_for(loaded: LoadedModel, replays: bool) -> tuple[Engine, list[int]]:
    engine = create_engine(loaded, EngineConfig(kv_cache_memory=4 << 20, max_num_seqs=4, batch_invariant=True))
    replayed: list[int] = []
    if replays:
        runner = engine.runner
        graphs = EagerReplays(runner._logits_of, 4, engine.max_model_len, runner.block_size, runner.device)
        graphs.capture()
        replay = graphs.replay

        def counted(*args: list) -> torch.Tensor:  # type: ignore[type-arg]
            replayed.append(len(args[0]))
            return replay(*args)

        graphs.replay = counted  # type: ignore[method-assign]
        runner.graphs = graphs
    return engine, replayed


def test_buckets_and_context_bounds() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert context_bound(1, 131072) == 131072 and context_bound(8, 131072) == 131072
    assert context_bound(256, 131072) == 16384 and context_bound(256, 4096) == 4096


def test_replayed_decode_steps_equal_eager_ones(loaded: LoadedModel) -> None:
    encode = loaded.tokenizer.encode
    prompts = {f"r{i}": encode(f"Request {i}: " + "the quick brown fox " * (1 + 2 * i)) for i in range(3)}
    eager, _ = engine_for(loaded, replays=False)
    expected = generate(eager, prompts, GREEDY)
    engine, replayed = engine_for(loaded, replays=True)
    assert generate(engine, prompts, GREEDY) == expected
    assert replayed and set(replayed) <= {1, 2, 3}  # three sequences decode in the 4-row bucket (one padding row)
