"""The models a server embeds and scores with: the served decoder (pooled) and any encoder models it loads."""

from __future__ import annotations

import dataclasses
import logging
import time

from statelm.api.embeddings.decoder import DecoderPooling
from statelm.api.embeddings.encoder import EncoderModelRunner
from statelm.api.embeddings.models import EmbeddingModel, EmbeddingModels
from statelm.api.embeddings.service import EmbeddingService
from statelm.api.limits import GenerationLimits
from statelm.api.serving import ServedModel, system_fingerprint
from statelm.config import EngineConfig
from statelm.engine.builder import BuiltEngine
from statelm.engine.encoder import EncoderEngine
from statelm.metrics import ServingMetrics
from statelm.models.encoder_loader import encoder_weight_bytes, load_encoder
from statelm.server.memory_budget import check_memory, module_bytes

log = logging.getLogger(__name__)


def embedding_service(
    built: BuiltEngine,
    served: ServedModel,
    engine_config: EngineConfig,
    metrics: ServingMetrics,
    limits: GenerationLimits,
    host_memory: int,
) -> EmbeddingService:
    """Embeddings of the served decoder model, pooled as --pooling says, and of every --embedding-model; the
    encoders' weights, with the decoder's weights and KV pool where they are in host memory too, must fit in
    host_memory (what the server may use)."""
    pooled = system_fingerprint(served.system_fingerprint, {"pooling": engine_config.pooling})
    decoder = EmbeddingModel(
        served=dataclasses.replace(served, system_fingerprint=pooled),
        tokenizer=built.loaded.tokenizer,
        runner=DecoderPooling(built.engine, engine_config.pooling),
        dimensions=built.loaded.config.hidden_size,
    )
    check_host_memory(built, engine_config.embedding_models, host_memory)
    encoders = [encoder_model(spec, engine_config.max_queue) for spec in engine_config.embedding_models]
    names = [model.served.name for model in (decoder, *encoders)]
    if len(set(names)) < len(names):
        raise ValueError(f"two served models have the same name: {', '.join(names)}")
    return EmbeddingService(EmbeddingModels([decoder, *encoders]), metrics, limits)


def check_host_memory(built: BuiltEngine, encoder_specs: list[str], host_memory: int) -> None:
    """Raise MemoryBudgetError unless the encoders' weights, and the decoder's weights and KV pool when it runs on
    the CPU, fit in host_memory (a GPU's memory is taken, and so checked, when the decoder loads)."""
    needs = [(f"{spec}'s weights", encoder_weight_bytes(spec)) for spec in encoder_specs]
    if built.loaded.device.type == "cpu":
        cache = built.engine.engine.runner.kv_cache  # the whole pool: on the CPU its pages are taken when written
        kv_pool = sum(tensor.nbytes for tensor in (*cache.k, *cache.v))
        needs = [("the chat model's weights", module_bytes(built.loaded.model)), ("its KV pool", kv_pool), *needs]
    check_memory(host_memory, needs)


def encoder_model(spec: str, max_queue: int) -> EmbeddingModel:
    """An encoder model loaded from spec, running on its own thread."""
    log.info("loading the encoder model %s", spec)
    loaded = load_encoder(spec)
    config = loaded.model.config
    served = ServedModel(
        name=loaded.name,
        aliases=frozenset({spec} - {loaded.name}),
        max_model_len=config.max_position_embeddings,
        created=int(time.time()),
        system_fingerprint=system_fingerprint(loaded.fingerprint, {}),
    )
    return EmbeddingModel(
        served=served,
        tokenizer=loaded.tokenizer,
        runner=EncoderModelRunner(EncoderEngine(loaded.model, loaded.pooling, max_queue)),
        dimensions=config.num_labels or config.hidden_size,
        matryoshka=loaded.matryoshka,
        cross_encoder=loaded.cross_encoder,
        post_processed=loaded.post_processed,
    )
