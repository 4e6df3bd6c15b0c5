"""Embeddings and scores of an encoder model (BERT embedders and cross-encoders) served beside the decoder."""

from __future__ import annotations

import torch

from statelm.api.embeddings.models import EncoderInput
from statelm.engine.encoder import EncoderEngine


class EncoderModelRunner:
    """An EncoderRunner over an encoder's own batching thread."""

    def __init__(self, engine: EncoderEngine) -> None:
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
