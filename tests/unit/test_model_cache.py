"""The model cache round-trips metadata and tensors, keys them by content, reuses valid entries, drops stale or
damaged ones, and keeps to its size cap by evicting the least recently used."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import platformdirs
import pytest
import torch

from statelm.models.model_cache import MANIFEST, METADATA, TENSORS, CachedModel, ModelCache

VARIANT = "dtype=float32"
METADATA_VALUE = {
    "fields": {"tokenizer.ggml.tokens": ["<s>", "Ġhello", "é\u2028\n", "\ud83d"], "llama.rope.freq_base": 1e5},
    "config": {"hidden_size": 8, "eos_token_ids": [2, 3], "rope_scaling": None, "tie": True},
}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A stand-in model file."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


@pytest.fixture
def cache(tmp_path: Path) -> ModelCache:
    """A cache rooted in the test's temporary directory."""
    return ModelCache(tmp_path / "cache")


def sample_tensors() -> dict[str, torch.Tensor]:
    """One small tensor of each dtype the loader stores."""
    generator = torch.Generator().manual_seed(0)
    floats = torch.randn(3, 5, generator=generator)
    return {
        "f32": floats,
        "bf16": floats.to(torch.bfloat16),
        "f16": floats.to(torch.float16),
        "i8": torch.randint(-128, 128, (7,), dtype=torch.int8, generator=generator),
        "u8": torch.randint(0, 256, (2, 2, 2), dtype=torch.uint8, generator=generator),
        "i32": torch.tensor([-(2**31), 0, 2**31 - 1], dtype=torch.int32),
        "i64": torch.tensor([[-(2**63), 2**63 - 1]], dtype=torch.int64),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
    }


def entry_dir(cache: ModelCache, source: Path, variant: str = VARIANT) -> Path:
    """The directory of an entry."""
    return cache.root / cache.key(source, variant)


def entry_names(cache: ModelCache) -> list[str]:
    """The names in the cache's directory, but for what it remembers of source files."""
    return sorted(path.name for path in cache.root.iterdir() if path.name != ".sources")


def assert_same(model: CachedModel | None, metadata: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The cached model holds exactly these metadata and tensors."""
    assert model is not None
    assert model.metadata == metadata
    assert list(model.tensors) == list(tensors)
    for name, tensor in tensors.items():
        assert model.tensors[name].dtype == tensor.dtype, name
        assert model.tensors[name].shape == tensor.shape, name
        assert torch.equal(model.tensors[name], tensor), name


def test_round_trip_of_every_dtype(cache: ModelCache, source: Path) -> None:
    assert cache.load(source, VARIANT) is None
    tensors = sample_tensors()
    cache.store(source, VARIANT, METADATA_VALUE, tensors)
    assert_same(cache.load(source, VARIANT), METADATA_VALUE, tensors)
    assert cache.load(source, "dtype=bfloat16") is None


def test_non_contiguous_and_shared_tensors(cache: ModelCache, source: Path) -> None:
    base = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    tensors = {
        "base": base,
        "transposed": base.t(),
        "strided": base[:, ::3],
        "slice": base[1:3],
        "tied": base,
        "grad": torch.ones(2, requires_grad=True),
    }
    cache.store(source, VARIANT, {}, tensors)
    model = cache.load(source, VARIANT)
    assert_same(model, {}, {name: tensor.detach() for name, tensor in tensors.items()})
    assert model is not None and not model.tensors["grad"].requires_grad


def test_entry_is_reused_without_rewriting(cache: ModelCache, source: Path) -> None:
    tensors = sample_tensors()
    cache.store(source, VARIANT, METADATA_VALUE, tensors)
    entry = entry_dir(cache, source)
    before = {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in entry.iterdir()}
    assert set(before) == {MANIFEST, METADATA, TENSORS}
    first = cache.load(source, VARIANT)
    second = cache.load(source, VARIANT)
    assert_same(first, METADATA_VALUE, tensors)
    assert_same(second, METADATA_VALUE, tensors)
    assert {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in entry.iterdir()} == before


def test_tensors_are_memory_mapped_copy_on_write(cache: ModelCache, source: Path) -> None:
    cache.store(source, VARIANT, {}, {"w": torch.zeros(4)})
    model = cache.load(source, VARIANT)
    assert model is not None
    model.tensors["w"].add_(1)
    assert torch.equal(model.tensors["w"], torch.ones(4))
    reloaded = cache.load(source, VARIANT)
    assert reloaded is not None and torch.equal(reloaded.tensors["w"], torch.zeros(4))


def test_changed_size_is_a_miss_and_gets_its_own_entry(cache: ModelCache, source: Path) -> None:
    cache.store(source, VARIANT, {"v": 1}, {"w": torch.zeros(2)})
    old_key = cache.key(source, VARIANT)
    source.write_bytes(source.read_bytes() + b"more")
    assert cache.load(source, VARIANT) is None
    cache.store(source, VARIANT, {"v": 2}, {"w": torch.ones(2)})
    assert_same(cache.load(source, VARIANT), {"v": 2}, {"w": torch.ones(2)})
    assert entry_names(cache) == sorted([old_key, cache.key(source, VARIANT)])  # the old one ages out by LRU


def test_same_content_elsewhere_or_touched_is_a_hit_hashed_once(
    cache: ModelCache, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache.store(source, VARIANT, {"v": 1}, {"w": torch.zeros(2)})
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(source.read_bytes())
    assert_same(cache.load(copy, VARIANT), {"v": 1}, {"w": torch.zeros(2)})  # another checkout's copy shares it
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 1_000_000_000))
    assert_same(cache.load(source, VARIANT), {"v": 1}, {"w": torch.zeros(2)})
    hashed: list[str] = []
    real_open = Path.open
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: hashed.append(self.name) or real_open(self, *a, **k))
    assert cache.load(source, VARIANT) is not None and cache.load(copy, VARIANT) is not None
    assert "model.gguf" not in hashed and "renamed.gguf" not in hashed  # unchanged files: remembered, not reread


def test_same_size_new_mtime_is_a_miss(cache: ModelCache, source: Path) -> None:
    cache.store(source, VARIANT, {"v": 1}, {"w": torch.zeros(2)})
    stat = source.stat()
    source.write_bytes(b"FUGG" + bytes(60))
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert source.stat().st_size == stat.st_size
    assert cache.load(source, VARIANT) is None


def test_an_entry_of_the_first_bytes_is_keyed_by_them_alone(cache: ModelCache, source: Path) -> None:
    head = len(source.read_bytes()) // 2
    cache.store(source, VARIANT, {"v": 1}, {}, hashed_bytes=head)
    assert cache.load(source, VARIANT) is None  # the whole file's key is another
    source.write_bytes(source.read_bytes()[:head] + b"changed past the head")
    assert_same(cache.load(source, VARIANT, hashed_bytes=head), {"v": 1}, {})
    source.write_bytes(b"X" + source.read_bytes()[1:])
    assert cache.load(source, VARIANT, hashed_bytes=head) is None


def test_missing_source_is_a_miss(cache: ModelCache, tmp_path: Path) -> None:
    assert cache.load(tmp_path / "absent.gguf", VARIANT) is None


def truncate_tensors(entry: Path) -> None:
    """Cut the last byte off the safetensors file."""
    data = (entry / TENSORS).read_bytes()
    (entry / TENSORS).write_bytes(data[:-1])


def corrupt_tensors_header(entry: Path) -> None:
    """Overwrite the safetensors header length, keeping the file size."""
    data = bytearray((entry / TENSORS).read_bytes())
    data[:8] = b"\xff" * 8
    (entry / TENSORS).write_bytes(bytes(data))


def corrupt_manifest(entry: Path) -> None:
    """Make manifest.json invalid JSON."""
    (entry / MANIFEST).write_text('{"format": 1, "source"')


def flip_metadata_byte(entry: Path) -> None:
    """Change one byte of metadata.json, keeping it valid JSON of the same size."""
    data = (entry / METADATA).read_bytes()
    (entry / METADATA).write_bytes(data.replace(b'"v"', b'"w"'))


def remove_tensors(entry: Path) -> None:
    """Delete the safetensors file."""
    (entry / TENSORS).unlink()


def remove_manifest(entry: Path) -> None:
    """Delete the manifest."""
    (entry / MANIFEST).unlink()


@pytest.mark.parametrize(
    "damage",
    [truncate_tensors, corrupt_tensors_header, corrupt_manifest, flip_metadata_byte, remove_tensors, remove_manifest],
)
def test_damaged_entry_is_dropped_and_rebuilt(
    cache: ModelCache, source: Path, damage, caplog: pytest.LogCaptureFixture
) -> None:
    tensors = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64)}
    cache.store(source, VARIANT, {"v": [1, 2]}, tensors)
    entry = entry_dir(cache, source)
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="statelm.models.model_cache"):
        assert cache.load(source, VARIANT) is None
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "damaged" in warnings[0].getMessage()
    assert entry_names(cache) == []
    caplog.clear()
    cache.store(source, VARIANT, {"v": [1, 2]}, tensors)
    assert_same(cache.load(source, VARIANT), {"v": [1, 2]}, tensors)
    assert not caplog.records


def test_store_leaves_no_temporaries_and_may_repeat(cache: ModelCache, source: Path) -> None:
    cache.store(source, VARIANT, {"v": 1}, {"w": torch.zeros(2)})
    cache.store(source, VARIANT, {"v": 1}, {"w": torch.zeros(2)})
    cache.store(source, "other", {"v": 3}, {"w": torch.zeros(3)})
    assert entry_names(cache) == sorted([cache.key(source, VARIANT), cache.key(source, "other")])
    assert_same(cache.load(source, VARIANT), {"v": 1}, {"w": torch.zeros(2)})


def test_failed_store_leaves_nothing(cache: ModelCache, source: Path) -> None:
    with pytest.raises(TypeError):
        cache.store(source, VARIANT, {"bad": object()}, {"w": torch.zeros(2)})
    assert entry_names(cache) == []


def test_concurrent_writers_and_readers(cache: ModelCache, source: Path, caplog: pytest.LogCaptureFixture) -> None:
    tensors = {"w": torch.randn(64, 64)}
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(5):
                cache.store(source, VARIANT, {"v": 1}, tensors)
        except BaseException as exc:
            errors.append(exc)

    def read() -> None:
        try:
            for _ in range(20):
                model = cache.load(source, VARIANT)
                if model is not None:
                    assert_same(model, {"v": 1}, tensors)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(3)] + [threading.Thread(target=read)]
    with caplog.at_level(logging.WARNING, logger="statelm.models.model_cache"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors
    assert not caplog.records
    assert entry_names(cache) == [cache.key(source, VARIANT)]
    assert_same(cache.load(source, VARIANT), {"v": 1}, tensors)


def test_past_its_cap_the_least_recently_used_go_first(tmp_path: Path, source: Path) -> None:
    cache = ModelCache(tmp_path / "cache", max_bytes=10_000)
    tensor = torch.zeros(900)  # 3.6 kB an entry: two fit, three do not
    for index in range(2):
        cache.store(source, f"v{index}", {}, {"w": tensor})
        os.utime(entry_dir(cache, source, f"v{index}"), (1_000_000 + index, 1_000_000 + index))
    assert cache.load(source, "v0") is not None  # used now: v1 is the least recently used
    cache.store(source, "v2", {}, {"w": tensor})
    assert [entry.variant for entry in cache.entries()] == ["v2", "v0"]
    assert sum(entry.size for entry in cache.entries()) <= 10_000
    leftover = cache.root / ".tmp-interrupted"
    leftover.mkdir()
    os.utime(leftover, (1_000_000, 1_000_000))
    in_progress = cache.root / ".tmp-in-progress"
    in_progress.mkdir()
    cache.prune()
    assert entry_names(cache) == sorted([in_progress.name, cache.key(source, "v0"), cache.key(source, "v2")])


def test_an_entry_larger_than_the_cap_is_not_kept(
    tmp_path: Path, source: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = ModelCache(tmp_path / "cache", max_bytes=1000)
    cache.store(source, "small", {}, {"w": torch.zeros(10)})
    with caplog.at_level(logging.WARNING, logger="statelm.models.model_cache"):
        cache.store(source, VARIANT, {}, {"w": torch.zeros(1000)})
    assert "exceed the model cache's cap" in caplog.text and "--model-cache-size" in caplog.text
    assert [entry.variant for entry in cache.entries()] == ["small"]  # and nothing was evicted for it


def test_entries_list_and_remove(cache: ModelCache, source: Path) -> None:
    assert cache.entries() == [] and cache.remove("0" * 32) is False
    cache.store(source, "a", {}, {"w": torch.zeros(4)})
    cache.store(source, "b", {}, {"w": torch.zeros(8)})
    entries = {entry.variant: entry for entry in cache.entries()}
    assert set(entries) == {"a", "b"} and entries["a"].source == str(source.resolve())
    assert entries["a"].size > 16 and entries["b"].size - entries["a"].size == 16
    assert cache.remove(entries["a"].key) and [entry.variant for entry in cache.entries()] == ["b"]
    assert cache.remove("..") is False and cache.remove(".sources") is False
    assert cache.clear() == 1 and cache.entries() == [] and list(cache.root.iterdir()) == []


def test_cache_dir_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: Path) -> None:
    monkeypatch.setenv("STATELM_CACHE_DIR", str(tmp_path / "env"))
    cache = ModelCache()
    assert cache.root == tmp_path / "env" / "models"
    cache.store(source, VARIANT, {}, {"w": torch.zeros(1)})
    assert (tmp_path / "env" / "models" / cache.key(source, VARIANT) / MANIFEST).is_file()
    assert ModelCache(tmp_path / "explicit").root == tmp_path / "explicit"
    monkeypatch.delenv("STATELM_CACHE_DIR")
    assert ModelCache().root == Path(platformdirs.user_cache_dir("statelm")) / "models"


def test_key_is_stable_hex(cache: ModelCache, source: Path, tmp_path: Path) -> None:
    key = cache.key(source, VARIANT)
    assert key == cache.key(tmp_path / "." / "model.gguf", VARIANT)
    assert key != cache.key(source, "other")
    int(key, 16)
