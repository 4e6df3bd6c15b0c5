"""A GGUF model converted once and kept in the model cache: later starts skip parsing and converting the file.

Parsing a GGUF's metadata with the gguf package costs seconds (its vocabulary is read element by element) and
converting its tensors more; the cache keeps the decoded metadata as JSON and the converted tensors (packed
weights included) in safetensors, memory-mapped on the next start. An entry is keyed by the file's content
and by the conversion settings, so a changed file is converted again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from statelm.models.config import ModelConfig
from statelm.models.gguf import load_gguf
from statelm.models.model_cache import ModelCache
from statelm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from statelm.kernels.quant import PackedWeight

log = logging.getLogger(__name__)

CONVERSION_VERSION = 2  # 2: packed weights interleaved in groups of 8 rows
_PACKED_SEPARATOR = "::"  # packed weight `name` is stored as tensors `name::part`


@dataclass
class ConvertedGGUF:
    """What the loader needs from a GGUF file: config, tokenizer, header digest and the converted weights."""

    config: ModelConfig
    tokenizer: Tokenizer
    metadata_digest: str
    weights: Callable[[], Iterator[tuple[str, torch.Tensor | PackedWeight]]]


def load_converted_gguf(path: Path, dtype: torch.dtype, packed: bool, cache: ModelCache | None = None) -> ConvertedGGUF:
    """The GGUF file's model from the cache, or converted now (with a progress bar) and then cached."""
    cache = cache or ModelCache()
    variant = f"v{CONVERSION_VERSION}:{str(dtype).removeprefix('torch.')}:{'packed' if packed else 'float'}"
    cached = cache.load(path, variant)
    if cached is not None:
        metadata = cached.metadata
        weights = _weights_from(cached.tensors, metadata["packed"])
        return ConvertedGGUF(
            config=ModelConfig(**{**metadata["config"], "eos_token_ids": tuple(metadata["config"]["eos_token_ids"])}),
            tokenizer=Tokenizer.from_gguf_fields(metadata["fields"]),
            metadata_digest=metadata["digest"],
            weights=lambda: iter(weights),
        )
    log.info("converting %s once into the model cache %s; later starts read it from there", path.name, cache.root)
    gguf = load_gguf(path, dtype)
    converted = list(gguf.tensors(packed=packed))
    tensors: dict[str, torch.Tensor] = {}
    packed_layout: dict[str, dict[str, Any]] = {}
    for name, value in converted:
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        else:
            packed_layout[name] = {"kind": value.kind, "shape": [value.out_features, value.in_features]}
            tensors.update({f"{name}{_PACKED_SEPARATOR}{part}": t for part, t in value.state().items()})
    metadata = {
        "fields": gguf.fields,
        "config": dataclasses.asdict(gguf.config),
        "digest": gguf.metadata_digest,
        "packed": packed_layout,
    }
    try:
        cache.store(path, variant, metadata, tensors)
    except OSError as exc:
        log.warning("could not write the model cache (%s); the next start converts %s again", exc, path.name)
    return ConvertedGGUF(gguf.config, gguf.tokenizer, gguf.metadata_digest, lambda: iter(converted))


def _weights_from(
    tensors: dict[str, torch.Tensor], packed_layout: dict[str, dict[str, Any]]
) -> list[tuple[str, torch.Tensor | PackedWeight]]:
    """Cached tensors back as (name, tensor or packed weight) pairs."""
    parts: dict[str, dict[str, torch.Tensor]] = {name: {} for name in packed_layout}
    weights: list[tuple[str, torch.Tensor | PackedWeight]] = []
    for key, tensor in tensors.items():
        name, _, part = key.partition(_PACKED_SEPARATOR)
        if part:
            parts[name][part] = tensor
        else:
            weights.append((name, tensor))
    if packed_layout:
        from statelm.kernels.quant import PackedWeight
    for name, layout in packed_layout.items():
        out_features, in_features = layout["shape"]
        weights.append((name, PackedWeight.from_state(layout["kind"], out_features, in_features, parts[name])))
    return weights
