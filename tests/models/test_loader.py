"""Model sources: HF folders (plain and sharded), dummy weights, hub cache, and clear errors."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hub_constants

from statelm.config import EngineConfig
from statelm.engine.builder import create_engine
from statelm.engine.sequence import SamplingParams
from statelm.models.loader import ModelLoadError, load_model, resolve_source
from tests.models.engine_run import generate
from tests.models.tiny_checkpoints import make_tiny_checkpoint
from tests.models.tiny_model_dir import make_tiny_model_dir, write_chatml_tokenizer

CPU = torch.device("cpu")


def greedy(model_dir: Path | str, load_format: str = "auto") -> list[int]:
    loaded = load_model(str(model_dir), CPU, torch.float32, load_format)
    engine = create_engine(loaded, EngineConfig(kv_cache_memory=8 << 20))
    prompt = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))
    return generate(engine, {"r": prompt}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))["r"]


def test_hf_folder_loads_and_generates(qwen2_dir: Path) -> None:
    loaded = load_model(str(qwen2_dir), CPU, torch.float32)
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert loaded.name == qwen2_dir.name
    assert loaded.tokenizer.eos_token_ids >= {loaded.tokenizer.token_to_id("<|im_end|>")}
    assert len(greedy(qwen2_dir)) == 8


def test_sharded_checkpoint_equals_single_file(qwen2_dir: Path, tmp_path: Path) -> None:
    import transformers

    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="100KB")
    write_chatml_tokenizer(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert greedy(sharded) == greedy(qwen2_dir)


def test_fingerprint_tracks_weights_and_dtype(qwen2_dir: Path, tmp_path: Path) -> None:
    first = load_model(str(qwen2_dir), CPU, torch.float32).fingerprint
    assert load_model(str(qwen2_dir), CPU, torch.float32).fingerprint == first
    assert load_model(str(qwen2_dir), CPU, torch.bfloat16).fingerprint != first
    other = make_tiny_model_dir("qwen2", tmp_path / "other", seed=1, vocab_size=520)
    assert load_model(str(other), CPU, torch.float32).fingerprint != first


def test_dummy_weights_are_random_but_seeded(qwen2_dir: Path) -> None:
    assert greedy(qwen2_dir, "dummy") == greedy(qwen2_dir, "dummy")
    loaded = load_model(str(qwen2_dir), CPU, torch.float32, "dummy", seed=3)
    assert loaded.config.architecture == "qwen2"
    assert torch.isfinite(loaded.model.embed_tokens.weight).all()


def test_hub_id_resolves_from_the_local_cache(qwen2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "models--tiny-org--tiny-qwen2"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(qwen2_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    source = resolve_source("tiny-org/tiny-qwen2")
    assert source.path == repo / "snapshots" / commit and source.name == "tiny-org/tiny-qwen2"
    assert greedy("tiny-org/tiny-qwen2") == greedy(qwen2_dir)
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        resolve_source("tiny-org/absent")


def test_bad_sources_give_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf at all")
    bad_config = tmp_path / "bad_config"
    bad_config.mkdir()
    (bad_config / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    for spec, words in [
        (str(tmp_path / "missing"), "not found"),
        (str(tmp_path / "empty"), "without config.json"),
        (str(tmp_path / "notes.txt"), "not a .gguf"),
        (str(tmp_path / "fake.gguf"), "cannot load"),
        (str(bad_config), "unsupported model_type"),
    ]:
        with pytest.raises(ModelLoadError, match=words) as info:
            load_model(spec, CPU, torch.float32)
        assert "\n" not in str(info.value)


def test_missing_weights_are_reported(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint("llama", tmp_path / "llama")
    write_chatml_tokenizer(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(str(folder), CPU, torch.float32)


def test_cli_prints_one_line_and_exits_nonzero(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "statelm", "serve", "--model", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("statelm: error: model")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_port_in_use_fails_the_start_at_once_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = ["serve", "--model", "default", "--port", str(port), "--state-dir", str(tmp_path / "state")]
        result = subprocess.run(
            [sys.executable, "-m", "statelm", *command],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2
    assert result.stderr.strip() == f"statelm: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert "loading model" not in result.stdout + result.stderr
