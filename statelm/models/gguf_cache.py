"""A GGUF model's parsed header kept in the model cache; its weights are always read from the file itself.

Quantized matrices are used in place from the memory-mapped file, and other tensors are small or converted at
load (dequantized models), so the cache holds no weights: only the decoded header (key/value metadata with the
tokenizer's vocabulary, tensor infos) and its digest, a few megabytes at most. A later start skips parsing the
header again. An entry is keyed by the file's first HEADER_KEY_BYTES (statelm.models.model_cache), which hold the
whole header of any GGUF it stores, so a changed header is read anew while a new file is not read through to be
found (a header larger than that is parsed at every start); it counts towards the cache's size cap like any
other.
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
HEADER_KEY_BYTES = 64 << 20  # hashed to find a file's entry: headers run to a few MB (a 256k-token vocabulary)


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
    cached = cache.load(path, variant, HEADER_KEY_BYTES)
    if cached is not None:
        gguf = load_gguf(path, dtype, packed, GGUFHeader.from_dict(cached.metadata["header"]))
    else:
        log.info("parsing %s's header once into the model cache %s (weights are read in place)", path.name, cache.root)
        gguf = load_gguf(path, dtype, packed)
        _store_header(cache, path, variant, gguf.file.header)
    return ConvertedGGUF(gguf.config, gguf.tokenizer, gguf.metadata_digest, gguf.tensors)


def _store_header(cache: ModelCache, path: Path, variant: str, header: GGUFHeader) -> None:
    """Keep a header just parsed for the next start, where the cache's key covers it."""
    if header.data_offset > HEADER_KEY_BYTES:
        log.info("%s's header is larger than the model cache's key: it is parsed at every start", path.name)
        return
    try:
        cache.store(path, variant, {"header": header.to_dict()}, {}, HEADER_KEY_BYTES)
    except OSError as exc:
        log.warning("could not write the model cache (%s); the next start parses %s again", exc, path.name)
