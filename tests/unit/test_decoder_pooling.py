"""The served decoder's embeddings over the engine seam: one engine call per input, pooled as asked, failures kept."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from statelm.api.embeddings.decoder import DecoderPooling
from statelm.api.embeddings.models import EncoderInput
from statelm.engine.client import EngineClient, EngineError
from statelm.models.pooling import Pooling
from tests.unit.fake_engine import FakeEngine

INPUTS = [EncoderInput([3, 4, 5]), EncoderInput([7]), EncoderInput([1, 2, 3, 4, 5, 6])]


def states(ids: list[int]) -> torch.Tensor:
    """The fake engine's hidden states of a prompt (see FakeEngine.embed)."""
    column = torch.tensor(ids, dtype=torch.float32)
    return torch.stack([column, -column, torch.ones_like(column)], dim=1)


@pytest.mark.parametrize(("pooling", "row"), [(Pooling.MEAN, None), (Pooling.LAST, -1), (Pooling.CLS, 0)])
def test_each_input_is_one_engine_prompt_pooled_as_asked(pooling: Pooling, row: int | None) -> None:
    engine = FakeEngine(reply=[])
    client: EngineClient = engine  # the fake is a whole EngineClient
    vectors = asyncio.run(DecoderPooling(client, pooling).run("emb", INPUTS))
    assert [request.request_id for request in engine.requests] == ["emb-0", "emb-1", "emb-2"]
    assert [request.prompt_ids for request in engine.requests] == [item.ids for item in INPUTS]
    for item, vector in zip(INPUTS, vectors, strict=True):
        hidden = states(item.ids)
        expected = hidden.mean(dim=0) if row is None else hidden[row]
        torch.testing.assert_close(vector, F.normalize(expected, dim=0), rtol=0, atol=1e-6)


def test_an_engine_failure_reaches_the_caller() -> None:
    engine = FakeEngine(reply=[], fail_with="engine error: out of memory")
    with pytest.raises(ExceptionGroup) as raised:
        asyncio.run(DecoderPooling(engine, Pooling.MEAN).run("emb", INPUTS))
    assert raised.group_contains(EngineError, match="out of memory")
