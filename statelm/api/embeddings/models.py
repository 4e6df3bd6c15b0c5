"""The models that embed and score, as the API sees them, and the routing of a request's `model` to one."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from statelm.api.errors import APIError, queue_full
from statelm.api.serving import ServedModel
from statelm.tokenizer import Tokenizer


@dataclass(frozen=True)
class EncoderInput:
    """Token ids to run, and for a pair (a cross-encoder's query and document) where the second segment starts."""

    ids: list[int]
    second_segment: int | None = None


class EncoderRunner(Protocol):
    """What runs token ids to vectors: the engine's decoder with pooling, or an encoder model's batcher."""

    max_queue: int

    def queue_is_full(self) -> bool:
        """True when no more requests may wait."""
        ...

    async def run(self, request_id: str, inputs: list[EncoderInput]) -> list[torch.Tensor]:
        """One float32 vector per input: a pooled embedding, or a cross-encoder's logits."""
        ...

    def close(self) -> None:
        """Stop what the runner owns."""
        ...


@dataclass
class EmbeddingModel:
    """A served model that embeds texts (or, a cross-encoder, scores pairs), its tokenizer and its runner."""

    served: ServedModel
    tokenizer: Tokenizer
    runner: EncoderRunner
    dimensions: int  # of its vectors (a cross-encoder: its labels)
    matryoshka: bool = False  # trained so that a prefix of its vector, renormalised, is an embedding
    cross_encoder: bool = False  # scores (query, document) pairs; embeds nothing
    post_processed: bool = False  # the tokenizer's own post-processor adds the special tokens ([CLS] … [SEP])

    def encode(self, text: str) -> list[int]:
        """A text's token ids with the model's special tokens."""
        if self.post_processed:
            return self.tokenizer.backend.encode(text, add_special_tokens=True).ids
        return self.tokenizer.encode(text, add_special_tokens=True)

    def encode_pair(self, first: str, second: str) -> EncoderInput:
        """A (query, document) pair as a cross-encoder reads it: `[CLS] first [SEP] second [SEP]`, the second
        segment marked."""
        if self.post_processed:
            encoding = self.tokenizer.backend.encode(first, second, add_special_tokens=True)
            types = encoding.type_ids
            return EncoderInput(encoding.ids, types.index(1) if 1 in types else len(types))
        head = self.encode(first)
        tail = self.encode(second)[1 if self.tokenizer.add_bos_token else 0 :]  # without its [CLS]
        return EncoderInput(head + tail, len(head))

    def admit(self) -> None:
        """429 when its queue is full."""
        if self.runner.queue_is_full():
            raise queue_full(self.runner.max_queue)


class EmbeddingModels:
    """Every model the embedding routes serve, found by the request's `model` (a name or an alias)."""

    def __init__(self, models: Iterable[EmbeddingModel]) -> None:
        self.models = list(models)

    def find(self, requested: str, *, scores: bool) -> EmbeddingModel:
        """The model a request names: 404 for none; 400 for one that cannot do what the route does (`scores`:
        rerank and score, which a cross-encoder or an embedding model can; else embeddings, which a cross-encoder
        cannot)."""
        for model in self.models:
            if requested == model.served.name or requested in model.served.aliases:
                if model.cross_encoder and not scores:
                    raise APIError(
                        f"`{requested}` is a reranker (a cross-encoder): it scores pairs at /v1/rerank and /v1/score"
                        " and makes no embeddings",
                        param="model",
                        code="model_not_supported",
                    )
                return model
        names = ", ".join(f"`{model.served.name}`" for model in self.models) or "none"
        raise APIError(
            f"The model `{requested}` does not exist; this server embeds with {names}.",
            status=404,
            param="model",
            code="model_not_found",
        )
