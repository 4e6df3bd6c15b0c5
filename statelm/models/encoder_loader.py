"""Loads an encoder model (a BERT or nomic-bert embedder, or a BERT cross-encoder) from a Hugging Face folder or a
GGUF file."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from statelm.config import Pooling
from statelm.models import nomic_bert
from statelm.models.bert import GGUF_NAMES, HF_BERT_NAMES, BertConfig, BertEncoder
from statelm.models.config import ModelConfigError
from statelm.models.gguf import dequantized
from statelm.models.gguf_file import GGUFFile
from statelm.models.loader import ModelLoadError, _read_safetensors, _safetensors_files, resolve_source
from statelm.tokenizer import Tokenizer, TokenizerError

# llama.cpp's `<arch>.pooling_type` values: an embedder's, and a reranker's (its classifier over [CLS])
GGUF_POOLING = {1: Pooling.MEAN, 2: Pooling.CLS, 3: Pooling.LAST}
GGUF_RANK_POOLING = 4
SENTENCE_TRANSFORMERS_POOLING = {"pooling_mode_mean_tokens": Pooling.MEAN, "pooling_mode_cls_token": Pooling.CLS,
                                 "pooling_mode_lasttoken": Pooling.LAST}  # fmt: skip

log = logging.getLogger(__name__)


@dataclass
class LoadedEncoder:
    """An encoder ready to run, with how its inputs are tokenized and its outputs pooled."""

    name: str
    model: BertEncoder
    tokenizer: Tokenizer
    pooling: Pooling  # of an embedding model's states (a cross-encoder classifies its first token's)
    post_processed: bool  # the tokenizer's own post-processor adds [CLS] … [SEP] (Hugging Face's tokenizer.json)
    matryoshka: bool = False  # trained so that a prefix of its vector, renormalised, is an embedding
    fingerprint: str = ""  # sha256 of what decides its outputs: weights (their bytes), config, tokenizer, pooling

    @property
    def cross_encoder(self) -> bool:
        """True for a reranker: it scores (query, document) pairs."""
        return self.model.config.num_labels > 0


def load_encoder(spec: str, dtype: torch.dtype = torch.float32) -> LoadedEncoder:
    """The encoder at spec (a folder, a .gguf file or a hub id), its weights in dtype."""
    source = resolve_source(spec)
    try:
        if source.is_gguf:
            loaded = _load_gguf(source.path, source.name, dtype)
            files = [source.path]
        else:
            loaded = _load_hf(source.path, source.name, dtype)
            files = [source.path / "config.json", *_safetensors_files(source.path)]
    except (ModelConfigError, TokenizerError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"{spec}: cannot load it as an encoder model ({exc})") from None
    loaded.fingerprint = _fingerprint(loaded, files, dtype)
    return loaded


def _fingerprint(loaded: LoadedEncoder, files: list[Path], dtype: torch.dtype) -> str:
    """sha256 of the weight and config files' bytes, the tokenizer, the pooling and the dtype: an encoder is small
    enough to hash whole, and two fine-tunes of one architecture differ only in their bytes."""
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    settings = [loaded.tokenizer.content_hash(), loaded.pooling.value, str(dtype), loaded.matryoshka]
    digest.update(json.dumps(settings).encode())
    return digest.hexdigest()


def encoder_weight_bytes(spec: str, dtype: torch.dtype = torch.float32) -> int:
    """Bytes the weights of the encoder at spec take once loaded in dtype, read from the files' headers alone."""
    source = resolve_source(spec)
    if source.is_gguf:
        elements = sum(math.prod(info.shape) for info in GGUFFile(source.path).header.tensors.values())
    else:
        headers = [_safetensors_header(file) for file in _safetensors_files(source.path)]
        elements = sum(math.prod(entry["shape"]) for header in headers for entry in header.values() if "shape" in entry)
    return elements * dtype.itemsize


def _safetensors_header(file: Path) -> dict[str, Any]:
    """A safetensors file's header: each tensor's dtype, shape and offsets (and `__metadata__`), read without
    mapping the file."""
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def _load_hf(path: Path, name: str, dtype: torch.dtype) -> LoadedEncoder:
    config = json.loads((path / "config.json").read_text())
    if nomic_bert.is_nomic_bert(config):
        model, names = BertEncoder(nomic_bert.config_from_hf(config), dtype), nomic_bert.HF_NAMES
    else:
        model, names = BertEncoder(BertConfig.from_hf(config), dtype), HF_BERT_NAMES
    model.load_weights(_read_safetensors(_safetensors_files(path), dtype), names)
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    tokenizer = Tokenizer.from_hf_dir(path)
    return LoadedEncoder(name, model.eval(), tokenizer, _sentence_pooling(path), True, matryoshka)


def _sentence_pooling(path: Path) -> Pooling:
    """The pooling a sentence-transformers folder declares (1_Pooling/config.json), else mean."""
    for module in _read_json(path / "modules.json") or []:
        if module.get("type", "").endswith("Pooling"):
            settings = _read_json(path / module.get("path", "") / "config.json") or {}
            for key, pooling in SENTENCE_TRANSFORMERS_POOLING.items():
                if settings.get(key):
                    return pooling
    return Pooling.MEAN


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _load_gguf(path: Path, name: str, dtype: torch.dtype) -> LoadedEncoder:
    file = GGUFFile(path)  # mapped: each tensor is converted from the file's pages into the model's dtype
    fields, tensors = file.header.fields, file.header.tensors
    architecture = fields.get("general.architecture")
    vocab = tensors["token_embd.weight"].shape[0]  # torch order: (vocab, hidden)
    types = tensors["token_types.weight"].shape[0] if "token_types.weight" in tensors else 0
    config = BertConfig.from_gguf(fields, set(tensors), vocab, types)
    model = BertEncoder(config, dtype)
    model.load_weights(((name, dequantized(file, info).to(dtype)) for name, info in tensors.items()), GGUF_NAMES)
    pooling = _gguf_pooling(int(fields.get(f"{architecture}.pooling_type", 1)), config)
    if config.num_labels and not config.pooler:
        log.warning(
            "%s: the reranker has no pooler (`cls`), as llama.cpp's converter writes BertForSequenceClassification: "
            "it scores as llama.cpp does, its classifier on the [CLS] state, not as the original model",
            path,
        )
    return LoadedEncoder(name, model.eval(), Tokenizer.from_gguf_fields(fields), pooling, False)


def _gguf_pooling(kind: int, config: BertConfig) -> Pooling:
    """An embedder's pooling from its `pooling_type`; a cross-encoder's (which classifies its first token) is CLS."""
    if config.num_labels:
        return Pooling.CLS
    if kind == GGUF_RANK_POOLING:
        raise ModelConfigError("pooling type rank, but the file holds no classifier (cls.output)")
    if kind not in GGUF_POOLING:
        raise ModelConfigError(f"pooling type {kind} is not mean, cls or last")
    return GGUF_POOLING[kind]
