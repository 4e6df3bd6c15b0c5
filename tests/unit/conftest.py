"""Unit-test fixtures: a state store of each kind, for tests that run the sessions layer on either."""

from __future__ import annotations

from pathlib import Path

import pytest

from statelm.sessions.directory_store import DirectoryStore
from statelm.sessions.state_store import StateStore
from tests.unit.memory_state_store import MemoryStore


@pytest.fixture(params=["directory", "memory"])
def state_store(request: pytest.FixtureRequest, tmp_path: Path) -> StateStore:
    """A DirectoryStore in a fresh directory, or a MemoryStore."""
    return DirectoryStore(tmp_path / "state") if request.param == "directory" else MemoryStore()
