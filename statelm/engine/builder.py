"""Builds a running engine from settings: model, KV cache sized from a memory budget, scheduler, thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from statelm.attention.kv_format import KVFormat, kv_format
from statelm.config import EngineConfig
from statelm.engine.async_engine import AsyncEngine
from statelm.engine.block_pool import BlockPool
from statelm.engine.cache_pins import CachePinTable
from statelm.engine.client import EngineClient
from statelm.engine.engine import SPECULATION_MAX_RUNNING, Engine
from statelm.engine.kv_cache import KVCache
from statelm.engine.runner import ModelRunner
from statelm.host_memory import available_host_memory
from statelm.kernels.build import use_kernel_threads
from statelm.models.compute_path import compute_paths, decoded_kv_exact, use_activations, use_compute_path, use_repack
from statelm.models.invariance import select_compute_path
from statelm.models.layers import RowChunking
from statelm.models.loader import LoadedModel, load_model, resolve_device, resolve_dtype, resolve_source
from statelm.models.model_cache import ModelCache
from statelm.models.packed import ACTIVATIONS

log = logging.getLogger(__name__)

# generation_config.json keys that are defaults of the request fields of the same names (as vLLM takes them)
GENERATION_CONFIG_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Sampling defaults statelm ships for models whose files declare none, by model name (lower case, without org or
# quantization suffix). The bundled model's card recommends temperature 0.2 and top_p 0.9, but with its Q4_1
# weights the first token of a plain question is a near tie ("The" -1.88 against "L" -1.97 for "What is the
# capital of France?"), so 0.2 still derails one reply in three: statelm ships greedy, with the card's top_p for
# requests that set a temperature.
MODEL_CARD_DEFAULTS: dict[str, dict[str, Any]] = {
    "smollm2-135m-instruct": {"temperature": 0.0, "top_p": 0.9},  # the bundled default model
}
DEFAULT_CPU_KV_BYTES = 2 << 30
GPU_FREE_MEMORY_FRACTION = 0.8
# Token budget of an engine step by default: on CPU a prompt step of 512 tokens put the 1B Q8_0 server's peak RSS
# at 1.15x llama-server's (its float32 activations, and what glibc keeps of them), 256 at 1.08x, for 4% of a
# 500-token prompt's time; a GPU keeps the larger step.
DEFAULT_CPU_STEP_TOKENS = 256
DEFAULT_GPU_STEP_TOKENS = 512
# A draft's most tokens by default (--speculative-tokens): a CPU step of 5 generated rows of a 1B Q4_K_M model takes
# 2.1x (VNNI) to 2.8x (AVX2) one row's time (bench/draft_rows.py), so longer drafts cost more than a likely run of
# copied tokens gives
DEFAULT_DRAFT_TOKENS = 4


class EngineConfigError(ValueError):
    """Settings that cannot make a working engine."""


@dataclass
class BuiltEngine:
    """The loaded model and the client of the engine thread serving it."""

    loaded: LoadedModel
    engine: EngineClient


def build_engine(config: EngineConfig) -> BuiltEngine:
    """Load the model, allocate the KV pool and start the engine thread."""
    loaded = load_engine_model(config)
    engine = create_engine(loaded, config)
    invariance = loaded.invariance  # None: batch invariance was not asked for
    report = invariance.as_dict() if invariance is not None else None
    return BuiltEngine(loaded, AsyncEngine(engine, config.max_queue, report))


def load_engine_model(config: EngineConfig) -> LoadedModel:
    """The model as the server runs it: device, dtype, packing and batch-invariant row chunking from config."""
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    chunking = RowChunking.batch_invariant(device) if config.batch_invariant else None
    packed = config.quantization != "none" and device.type == "cpu"
    if config.dtype == "auto" and packed and (resolve_source(config.model).is_gguf or config.quantization != "auto"):
        dtype = torch.float32  # packed weights run in statelm's float32 kernels on every CPU
    else:
        dtype = resolve_dtype(config.dtype, device)
    cache = ModelCache(max_bytes=config.model_cache_size)
    loaded = load_model(
        config.model, device, dtype, config.load_format, config.seed, chunking, config.quantization, cache
    )
    use_repack(loaded.model, config.repack)  # before the self-check runs the kernels
    try:
        if use_activations(loaded.model, config.activations):
            # what the KV means: snapshots and sessions hold only KV a prefill computes, in prompt rows' arithmetic
            loaded.fingerprint.parts["activations"] = ACTIVATIONS[loaded.model.activations][0]
            if config.activations == "auto":
                log.info("activations: %s (auto, by the model's size)", loaded.model.activations)
    except ValueError as exc:
        raise EngineConfigError(str(exc)) from None
    return loaded


def create_engine(loaded: LoadedModel, config: EngineConfig) -> Engine:
    """A synchronous engine over a loaded model, with a KV pool sized from the memory budget.

    A model loaded for batch-invariant output gets its compute path from the start-up self-check first.
    """
    model = loaded.model
    kv = kv_cache_format(config.kv_cache_dtype, loaded)
    if model.batch_invariant and loaded.invariance is None:
        try:
            loaded.invariance = select_compute_path(model, config.compute_path, kv)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from None
        loaded.fingerprint.parts["compute_path"] = model.compute_path  # KV rounding depends on it
    elif not model.batch_invariant and loaded.device.type == "cuda":
        use_compute_path(model, compute_paths(model)[0])  # no probe: the fastest path (Triton attention)
    threads = use_kernel_threads() if model.compute_path == "kernels" else torch.get_num_threads()
    loaded.fingerprint.parts["kv_cache_dtype"] = kv.name  # snapshots hold this KV
    model_config = loaded.config
    block_bytes = KVCache.bytes_per_block(
        model_config.num_hidden_layers,
        config.block_size,
        model_config.num_key_value_heads,
        model_config.head_dim,
        kv,
    )
    num_blocks = _kv_budget(config, loaded.device) // block_bytes
    max_model_len = min(
        model_config.max_position_embeddings,
        config.max_model_len or model_config.max_position_embeddings,
        num_blocks * config.block_size,
    )
    if max_model_len < config.block_size:
        raise EngineConfigError(f"KV cache budget holds only {num_blocks} blocks; raise --kv-cache-memory")
    log.info(
        "allocating the KV cache: %d blocks of %d tokens (%.1f MiB, %s, %d bytes a token); max model len %d; %s on %s, "
        "%d threads",
        num_blocks,
        config.block_size,
        num_blocks * block_bytes / 2**20,
        kv.name,
        block_bytes // config.block_size,
        max_model_len,
        loaded.dtype,
        loaded.device,
        threads,
    )
    kv_cache = KVCache(
        model_config.num_hidden_layers,
        num_blocks,
        config.block_size,
        model_config.num_key_value_heads,
        model_config.head_dim,
        kv,
        loaded.device,
    )
    cuda_graphs = loaded.device.type == "cuda" and model.compute_path == "triton" and not config.enforce_eager
    exact = loaded.invariance is not None and loaded.invariance.verified and decoded_kv_exact(model)
    if exact:
        log.info("generated tokens' K/V are a prefill's (%s rows of either kind): cached and kept as computed",
                 model.activations)  # fmt: skip
    draft_tokens = speculation_length(config, loaded)
    if draft_tokens:
        log.info("drafts by prompt lookup: up to %d tokens a step, verified while at most %d sequences run",
                 draft_tokens, SPECULATION_MAX_RUNNING)  # fmt: skip
    return Engine(
        runner=ModelRunner(
            model,
            kv_cache,
            loaded.device,
            cuda_graphs=cuda_graphs,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
        ),
        pool=BlockPool(
            num_blocks, config.block_size, config.enable_prefix_caching, cache_pin_table(config, num_blocks)
        ),
        eos_token_ids=loaded.tokenizer.eos_token_ids,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=step_token_budget(config, loaded.device),
        sampling_defaults=sampling_defaults(loaded, config),
        vocab_size=loaded.tokenizer.vocab_size,
        decoded_kv_exact=exact,
        refresh_replies=config.refresh_replies,
        speculative_tokens=draft_tokens,
    )


def cache_pin_table(config: EngineConfig, num_blocks: int) -> CachePinTable:
    """The cache pins' table, its caps the configured shares of the pool's blocks."""
    return CachePinTable(
        max_blocks=int(config.pinned_kv_fraction * num_blocks),
        max_blocks_per_owner=int(config.pinned_kv_fraction_per_key * num_blocks),
    )


def kv_cache_format(name: str, loaded: LoadedModel) -> KVFormat:
    """The KV cache's format for --kv-cache-dtype: `auto` is 16-bit, on every device and CPU class.

    auto keeps a 16-bit model's own dtype (its K/V are computed in it: nothing is lost), and stores a float32 model's
    K/V in float16: three more significant bits than bfloat16 (on the default model, 99.97% top-1 agreement with
    float32 KV against bfloat16's 99.45%, docs/benchmarks.md), and read as fast (one widening instruction on every
    x86 class since AVX2, F16C). Every format is read in place by the attention of every compute path.
    """
    if name == "auto":
        return kv_format(loaded.dtype if loaded.dtype in (torch.float16, torch.bfloat16) else torch.float16)
    try:
        kv = kv_format(name)
        kv.check_head_dim(loaded.config.head_dim)
    except ValueError as exc:
        raise EngineConfigError(str(exc)) from None
    return kv


def sampling_defaults(loaded: LoadedModel, config: EngineConfig) -> dict[str, Any]:
    """Defaults of requests' sampling fields: --default-sampling over the model's generation config, over the
    defaults statelm ships for a model whose files declare none."""
    generation_config = loaded.generation_config
    from_model = {key: generation_config[key] for key in GENERATION_CONFIG_DEFAULTS if key in generation_config}
    return {**(from_model or model_card_defaults(loaded.name)), **config.default_sampling}


def model_card_defaults(model_name: str) -> dict[str, Any]:
    """The sampling defaults statelm ships for a model, or none.

    The name matches with any organisation (`HuggingFaceTB/`) and file suffix (`-Q8_0`) around it.
    """
    base = model_name.rsplit("/", 1)[-1].lower()
    for name, defaults in MODEL_CARD_DEFAULTS.items():
        if base == name or base.startswith(f"{name}-") or base.startswith(f"{name}."):
            return dict(defaults)
    return {}


def speculation_length(config: EngineConfig, loaded: LoadedModel) -> int:
    """A draft's most tokens: --speculative-tokens, else DEFAULT_DRAFT_TOKENS on a CPU whose compute path the self-check
    verified batch-invariant (its verified drafts give exactly one-at-a-time decoding's tokens), else none: a GPU's
    decode steps replay CUDA graphs, which a draft's rows would give up."""
    if config.speculative_tokens is not None:
        return config.speculative_tokens
    verified = loaded.invariance is not None and loaded.invariance.verified
    return DEFAULT_DRAFT_TOKENS if loaded.device.type == "cpu" and verified else 0


def step_token_budget(config: EngineConfig, device: torch.device) -> int:
    """The token budget of one engine step: --max-num-batched-tokens, else the device's default."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    return DEFAULT_GPU_STEP_TOKENS if device.type == "cuda" else DEFAULT_CPU_STEP_TOKENS


def _kv_budget(config: EngineConfig, device: torch.device) -> int:
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_FREE_MEMORY_FRACTION)
    return min(DEFAULT_CPU_KV_BYTES, available_host_memory() // 4)
