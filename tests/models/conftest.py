"""Shared tiny model folders for the model and engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.tiny_model_dir import make_tiny_model_dir


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 checkpoint with a ChatML tokenizer."""
    return make_tiny_model_dir("qwen2", tmp_path_factory.mktemp("qwen2"))
