"""A GGUF model is converted once: later loads come from the model cache, until the file changes or the entry breaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from statelm.models import gguf_cache
from statelm.models.gguf_cache import load_converted_gguf
from statelm.models.model_cache import TENSORS, ModelCache
from tests.models.test_gguf import _attention_tensors, write_gguf


def as_dict(weights: Any) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in weights()}


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    stored, _ = _attention_tensors(np.random.default_rng(3), permute=True)
    return write_gguf(tmp_path / "model.gguf", stored, arch="llama")


def forbid_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf_cache, "load_gguf", fail)


def test_a_second_load_comes_from_the_cache_unchanged(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ModelCache(tmp_path / "cache")
    first = load_converted_gguf(gguf_file, torch.float32, packed=False, cache=cache)
    forbid_conversion(monkeypatch)
    second = load_converted_gguf(gguf_file, torch.float32, packed=False, cache=cache)
    assert second.config == first.config
    assert second.metadata_digest == first.metadata_digest
    assert second.tokenizer.content_hash() == first.tokenizer.content_hash()
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    expected, cached = as_dict(first.weights), as_dict(second.weights)
    assert expected.keys() == cached.keys()
    assert all(torch.equal(expected[name], cached[name]) for name in expected)


def test_a_changed_file_is_converted_again(gguf_file: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    load_converted_gguf(gguf_file, torch.float32, packed=False, cache=cache)
    stored, _ = _attention_tensors(np.random.default_rng(4), permute=True)
    write_gguf(gguf_file, stored, arch="llama", metadata={"context_length": 512})
    reloaded = load_converted_gguf(gguf_file, torch.float32, packed=False, cache=cache)
    assert reloaded.config.max_position_embeddings == 512


def test_a_damaged_entry_is_rebuilt_with_one_warning(
    gguf_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ModelCache(tmp_path / "cache")
    first = load_converted_gguf(gguf_file, torch.float32, packed=False, cache=cache)
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and not p.name.startswith(".")]
    tensors = entry / TENSORS
    tensors.write_bytes(tensors.read_bytes()[:100])
    rebuilt = load_converted_gguf(gguf_file, torch.float32, packed=False, cache=cache)
    assert [r.levelname for r in caplog.records if r.name == "statelm.models.model_cache"] == ["WARNING"]
    assert as_dict(rebuilt.weights).keys() == as_dict(first.weights).keys()
    forbid_conversion(monkeypatch)
    assert as_dict(load_converted_gguf(gguf_file, torch.float32, packed=False, cache=cache).weights).keys()
