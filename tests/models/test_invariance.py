"""The start-up self-check picks a batch-invariant compute path, and catches a kernel that is not."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from statelm.config import EngineConfig
from statelm.engine.builder import EngineConfigError, create_engine
from statelm.models import layers
from statelm.models.compute_path import compute_paths
from statelm.models.invariance import probe_model, select_compute_path
from statelm.models.layers import RowChunking
from statelm.models.loader import LoadedModel, load_model

pytestmark = [pytest.mark.invariance]


def tiny_model(qwen2_dir: Path) -> LoadedModel:
    return load_model(str(qwen2_dir), torch.device("cpu"), torch.float32, chunking=RowChunking.batch_invariant())


def row_count_dependent_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A matmul whose rounding depends on how many real (non-padding) rows share the call, as some CPU GEMMs do."""
    real_rows = int(x.abs().sum(dim=1).gt(0).sum())
    return F.linear(x, weight, bias) + 1e-4 * real_rows


def test_every_path_offered_here_is_probed_and_the_chosen_one_passes(qwen2_dir: Path) -> None:
    loaded = tiny_model(qwen2_dir)
    report = select_compute_path(loaded.model)
    assert report.verified
    assert report.path == loaded.model.compute_path == compute_paths(loaded.model)[len(report.rejected)]
    assert probe_model(loaded.model) == []
    health = report.as_dict()
    assert health["path"] == report.path and health["verified"] is True and "torch" in str(health["cpu"])


def test_torch_per_row_is_invariant_on_any_cpu(qwen2_dir: Path) -> None:
    loaded = tiny_model(qwen2_dir)
    report = select_compute_path(loaded.model, forced="torch-per-row")
    assert report.verified and report.rejected == {}


def test_a_row_count_dependent_kernel_is_caught_and_the_engine_falls_back(
    qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    loaded = tiny_model(qwen2_dir)
    monkeypatch.setattr(layers, "F", SimpleNamespace(linear=row_count_dependent_linear))
    loaded.model.compute_paths = lambda: ["torch", "torch-per-row"]  # type: ignore[method-assign]
    create_engine(loaded, EngineConfig(kv_cache_memory=8 << 20))
    report = loaded.invariance
    assert report is not None and report.verified
    assert report.path == loaded.model.compute_path == "torch-per-row"
    assert any("qkv_proj" in failure and "differs inside" in failure for failure in report.rejected["torch"])
    assert "rejected 'torch'" in caplog.text


def test_a_forced_path_that_fails_is_reported_not_verified(qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = tiny_model(qwen2_dir)
    monkeypatch.setattr(layers, "F", SimpleNamespace(linear=row_count_dependent_linear))
    report = select_compute_path(loaded.model, forced="torch")
    assert not report.verified and report.path == "torch" and "NOT batch-invariant" in report.summary()


def test_an_unknown_forced_path_is_a_config_error(qwen2_dir: Path) -> None:
    with pytest.raises(EngineConfigError, match="not available"):
        create_engine(tiny_model(qwen2_dir), EngineConfig(kv_cache_memory=8 << 20, compute_path="fastest"))
