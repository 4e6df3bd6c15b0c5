"""Shared tiny model folders for the model and engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from statelm.engine import engine
from tests.models.tiny_model_dir import make_tiny_model_dir


@pytest.fixture(autouse=True)
def reply_refreshes_start_when_the_engine_idles(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests step an engine until it has no work, a reply's refresh included: it starts at once, not after the
    server's wait for a request that comes right away (test_session_engine.py checks that wait)."""
    monkeypatch.setattr(engine, "REPLY_REFRESH_IDLE_S", 0.0)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 checkpoint with a ChatML tokenizer."""
    return make_tiny_model_dir("qwen2", tmp_path_factory.mktemp("qwen2"))
