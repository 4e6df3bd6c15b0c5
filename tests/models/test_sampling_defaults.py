"""Per-model sampling defaults: generation_config.json, overridden by --default-sampling, checked like requests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from statelm.api.protocol import SamplerSettings
from statelm.api.serving import sampling_defaults
from statelm.config import EngineConfig
from statelm.engine.builder import create_engine
from statelm.models.loader import load_model


def test_the_model_folder_gives_defaults_that_the_server_overrides(
    qwen2_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(qwen2_dir, model_dir)
    generation_config = {"temperature": 0.6, "top_k": 20, "top_p": 5, "do_sample": True, "max_new_tokens": 9}
    (model_dir / "generation_config.json").write_text(json.dumps(generation_config))
    loaded = load_model(str(model_dir), torch.device("cpu"), torch.float32)
    engine = create_engine(loaded, EngineConfig(kv_cache_memory=8 << 20, default_sampling={"top_k": 5}))
    assert engine.sampling_defaults == {"temperature": 0.6, "top_k": 5, "top_p": 5}
    assert sampling_defaults(engine.sampling_defaults) == SamplerSettings(temperature=0.6, top_k=5)
    assert "ignoring the sampling default top_p=5" in caplog.text
