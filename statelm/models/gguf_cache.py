"""A GGUF model's parsed header kept in the model cache; its weights are always read from the file itself.

Quantized matrices are used in place from the memory-mapped file, and other tensors are small or converted at
load (dequantized models), so the cache holds no weights: only the decoded header (key/value metadata with the
tokenizer's vocabulary, tensor infos) and its digest, a few megabytes at most. A later start skips parsing the
header again. An entry is keyed by the file's content (statelm.models.model_cache), so a changed file is read
anew, and counts towards the cache's size cap like any other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from statelm.models.config import ModelConfig
from statelm.models.gguf import load_gguf
from statelm.models.gguf_file import GGUFHeader
from statelm.models.model_cache import ModelCache
from statelm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from statelm.kernels.quant import PackedWeight

log = logging.getLogger(__name__)

HEADER_VERSION = 3  # 3: the header only (2 held the converted tensors)


@dataclass
class ConvertedGGUF:
    """What the loader needs from a GGUF file: config, tokenizer, header digest and the weights."""

    config: ModelConfig
    tokenizer: Tokenizer
    metadata_digest: str
    weights: Callable[[], Iterator[tuple[str, torch.Tensor | PackedWeight]]]


def load_converted_gguf(path: Path, dtype: torch.dtype, packed: bool, cache: ModelCache | None = None) -> ConvertedGGUF:
    """The GGUF file opened with its header from the cache (or parsed now, then cached); packed: quantized matrices
    in place, else every tensor dequantized to dtype (see statelm.models.gguf.GGUFModel)."""
    cache = cache or ModelCache()
    variant = f"v{HEADER_VERSION}:header"
    cached = cache.load(path, variant)
    if cached is None:
        log.info("parsing %s's header once into the model cache %s (weights are read in place)", path.name, cache.root)
    header = GGUFHeader.from_dict(cached.metadata["header"]) if cached is not None else None
    gguf = load_gguf(path, dtype, packed, header)
    if cached is None:
        try:
            cache.store(path, variant, {"header": gguf.file.header.to_dict()}, {})
        except OSError as exc:
            log.warning("could not write the model cache (%s); the next start parses %s again", exc, path.name)
    return ConvertedGGUF(gguf.config, gguf.tokenizer, gguf.metadata_digest, gguf.tensors)
