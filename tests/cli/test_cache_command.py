"""`statelm cache ls|rm` over a model cache of real entries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from statelm.models.model_cache import ModelCache
from tests.cli.helpers import run_cli


@pytest.fixture
def cache_env(tmp_path: Path) -> tuple[dict[str, str], ModelCache, Path]:
    """STATELM_CACHE_DIR pointing at a cache with two entries of one source file."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF" + bytes(60))
    cache = ModelCache(tmp_path / "cache" / "models")
    cache.store(source, "float", {}, {"w": torch.zeros(256)})
    cache.store(source, "packed", {}, {"w": torch.zeros(16)})
    return {"STATELM_CACHE_DIR": str(tmp_path / "cache")}, cache, source


def test_ls_shows_each_entry_and_the_total(cache_env: tuple[dict[str, str], ModelCache, Path]) -> None:
    env, cache, source = cache_env
    result = run_cli(["cache", "ls"], env)
    assert result.exit_code == 0, result.output
    for entry in cache.entries():
        assert entry.key[:12] in result.stdout
    assert "float" in result.stdout and "packed" in result.stdout and "model.gguf" in result.stdout
    assert "2 entries, " in result.stdout and str(cache.root) in result.stdout
    listed = json.loads(run_cli(["cache", "ls", "--json"], env).stdout)
    assert {row["variant"] for row in listed} == {"float", "packed"} and listed[0]["source"] == str(source.resolve())


def test_rm_removes_by_key_prefix_or_all(cache_env: tuple[dict[str, str], ModelCache, Path]) -> None:
    env, cache, _ = cache_env
    keys = {entry.variant: entry.key for entry in cache.entries()}
    result = run_cli(["cache", "rm", keys["float"][:8]], env)
    assert result.exit_code == 0 and f"removed {keys['float']}" in result.stdout
    assert [entry.variant for entry in cache.entries()] == ["packed"]
    missing = run_cli(["cache", "rm", "zz"], env)
    assert missing.exit_code == 1 and "'zz' names no cache entries" in missing.stderr
    neither = run_cli(["cache", "rm"], env)
    assert neither.exit_code == 1 and "or pass --all" in neither.stderr
    assert "removed 1 entry" in run_cli(["cache", "rm", "--all"], env).stdout
    assert cache.entries() == [] and "0 entries" in run_cli(["cache", "ls"], env).stdout
