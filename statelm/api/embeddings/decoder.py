"""Embeddings of the served decoder model: each input runs through the engine as a prompt that samples nothing,
its final hidden states pooled (mean, last token or first token) and normalised."""

from __future__ import annotations

import asyncio

import torch

from statelm.api.embeddings.models import EncoderInput
from statelm.engine.client import EngineClient
from statelm.models.pooling import PooledRows, Pooling


class DecoderPooling:
    """An EncoderRunner over the generation engine: inputs are batched with whatever else runs, KV is freed as
    each ends (its full blocks stay in the prefix cache, which a later last-token pooling may reuse)."""

    def __init__(self, engine: EngineClient, pooling: Pooling) -> None:
        self.engine = engine
        self.pooling = pooling
        self.max_queue = engine.info.max_queue

    def queue_is_full(self) -> bool:
        """True when the engine's queue is full."""
        return self.engine.queue_is_full()

    def close(self) -> None:
        """Nothing to stop: the engine belongs to the app."""

    async def run(self, request_id: str, inputs: list[EncoderInput]) -> list[torch.Tensor]:
        """One unit vector per input; if one fails, the others are stopped."""
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._embed(f"{request_id}-{i}", item.ids)) for i, item in enumerate(inputs)]
        return [task.result() for task in tasks]

    async def _embed(self, request_id: str, ids: list[int]) -> torch.Tensor:
        output = await self.engine.embed(request_id, ids, PooledRows(self.pooling, len(ids)))
        assert output.embedding is not None
        return output.embedding
