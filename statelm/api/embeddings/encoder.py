"""Embeddings and scores of an encoder model (BERT embedders and cross-encoders) served beside the decoder."""

from __future__ import annotations

from typing import Protocol

import torch

from statelm.api.embeddings.models import EncoderInput


class EncoderBatcher(Protocol):
    """What the API asks of an encoder model's batching thread (statelm.engine.encoder.EncoderEngine)."""

    max_queue: int

    def queue_is_full(self) -> bool:
        """True when its queue is full."""
        ...

    async def run(self, ids: list[list[int]], second_segments: list[int | None]) -> list[torch.Tensor]:
        """One vector (or a cross-encoder's logits) per input."""
        ...

    def shutdown(self) -> None:
        """Stop its thread."""
        ...


class EncoderModelRunner:
    """An EncoderRunner over an encoder's own batching thread."""

    def __init__(self, engine: EncoderBatcher) -> None:
        self.engine = engine
        self.max_queue = engine.max_queue

    def queue_is_full(self) -> bool:
        """True when the encoder's queue is full."""
        return self.engine.queue_is_full()

    async def run(self, request_id: str, inputs: list[EncoderInput]) -> list[torch.Tensor]:
        """One vector per input: pooled and normalised, or a cross-encoder's logits."""
        return await self.engine.run([item.ids for item in inputs], [item.second_segment for item in inputs])

    def close(self) -> None:
        """Stop the encoder's thread."""
        self.engine.shutdown()
