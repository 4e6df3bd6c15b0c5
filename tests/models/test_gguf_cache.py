"""A GGUF's parsed header is cached, and only that: later loads skip parsing it, until the file changes or the
entry breaks; weights always come from the file."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from statelm.models import gguf_cache, gguf_file
from statelm.models.gguf_cache import load_converted_gguf
from statelm.models.model_cache import METADATA, TENSORS, ModelCache
from tests.models.test_gguf import _attention_tensors, write_gguf


def as_dict(weights: Any) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in weights()}


@pytest.fixture
def gguf_file_path(tmp_path: Path) -> Path:
    stored, _ = _attention_tensors(np.random.default_rng(3), permute=True)
    return write_gguf(tmp_path / "model.gguf", stored, arch="llama")


def forbid_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise AssertionError("the GGUF header was parsed again")

    monkeypatch.setattr(gguf_file, "_parse", fail)


def entry_of(root: Path) -> Path:
    (entry,) = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return entry


def test_a_second_load_reads_the_header_from_the_cache(
    gguf_file_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ModelCache(tmp_path / "cache")
    first = load_converted_gguf(gguf_file_path, torch.float32, packed=False, cache=cache)
    forbid_parsing(monkeypatch)
    second = load_converted_gguf(gguf_file_path, torch.float32, packed=False, cache=cache)
    assert second.config == first.config
    assert second.metadata_digest == first.metadata_digest
    assert second.tokenizer.content_hash() == first.tokenizer.content_hash()
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    expected, cached = as_dict(first.weights), as_dict(second.weights)
    assert expected.keys() == cached.keys()
    assert all(torch.equal(expected[name], cached[name]) for name in expected)


def test_the_cache_holds_the_header_and_no_weights(gguf_file_path: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    load_converted_gguf(gguf_file_path, torch.float32, packed=True, cache=cache)
    entry = entry_of(tmp_path / "cache")
    assert (entry / TENSORS).stat().st_size < 100  # an empty safetensors file
    assert (entry / METADATA).stat().st_size < gguf_file_path.stat().st_size
    load_converted_gguf(gguf_file_path, torch.float32, packed=False, cache=cache)  # one entry serves both
    assert entry_of(tmp_path / "cache") == entry


def test_a_changed_file_is_parsed_again(gguf_file_path: Path, tmp_path: Path) -> None:
    cache = ModelCache(tmp_path / "cache")
    load_converted_gguf(gguf_file_path, torch.float32, packed=False, cache=cache)
    stored, _ = _attention_tensors(np.random.default_rng(4), permute=True)
    write_gguf(gguf_file_path, stored, arch="llama", metadata={"context_length": 512})
    reloaded = load_converted_gguf(gguf_file_path, torch.float32, packed=False, cache=cache)
    assert reloaded.config.max_position_embeddings == 512


def test_new_weights_under_the_same_header_are_a_hit(
    gguf_file_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    header_bytes = gguf_file.GGUFFile(gguf_file_path).header.data_offset
    monkeypatch.setattr(gguf_cache, "HEADER_KEY_BYTES", header_bytes)
    cache = ModelCache(tmp_path / "cache")
    first = as_dict(load_converted_gguf(gguf_file_path, torch.float32, packed=False, cache=cache).weights)
    data = bytearray(gguf_file_path.read_bytes())
    data[header_bytes] ^= 0xFF  # the first weight's first byte
    gguf_file_path.write_bytes(bytes(data))
    forbid_parsing(monkeypatch)
    second = as_dict(load_converted_gguf(gguf_file_path, torch.float32, packed=False, cache=cache).weights)
    assert [name for name in first if not torch.equal(first[name], second[name])]  # read from the file


def test_a_header_past_the_key_is_not_kept(
    gguf_file_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gguf_cache, "HEADER_KEY_BYTES", 64)
    cache = ModelCache(tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger="statelm.models.gguf_cache"):
        load_converted_gguf(gguf_file_path, torch.float32, packed=False, cache=cache)
    assert "parsed at every start" in caplog.text
    assert not cache.entries()


def test_a_damaged_entry_is_rebuilt_with_one_warning(
    gguf_file_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ModelCache(tmp_path / "cache")
    first = load_converted_gguf(gguf_file_path, torch.float32, packed=False, cache=cache)
    metadata = entry_of(tmp_path / "cache") / METADATA
    metadata.write_bytes(metadata.read_bytes()[:100])
    rebuilt = load_converted_gguf(gguf_file_path, torch.float32, packed=False, cache=cache)
    assert [r.levelname for r in caplog.records if r.name == "statelm.models.model_cache"] == ["WARNING"]
    assert as_dict(rebuilt.weights).keys() == as_dict(first.weights).keys()
    forbid_parsing(monkeypatch)
    assert as_dict(load_converted_gguf(gguf_file_path, torch.float32, packed=False, cache=cache).weights).keys()
