"""The start-up memory check: what a model's weights take, what a control group leaves, the error, and the default KV
pool's share of available memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from statelm import host_memory
from statelm.config import EngineConfig
from statelm.engine import builder
from statelm.kernels.quant import PackedWeight, quantize
from statelm.models.layers import RowChunking
from statelm.models.packed import PackedLinear
from statelm.server.memory_budget import MemoryBudgetError, check_memory, module_bytes


def test_module_bytes_counts_parameters_buffers_and_packed_weights_once() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(100, 64)  # 25,600 bytes
    model.head = nn.Linear(64, 100, bias=False)
    model.head.weight = model.embed.weight  # tied: counted once
    model.register_buffer("scale", torch.ones(16, dtype=torch.float64))  # 128 bytes
    packed = quantize(torch.randn(64, 256), "int8")
    model.proj = PackedLinear(packed, torch.zeros(64), RowChunking())  # the packed tensors and a 256-byte bias
    assert module_bytes(model) == 100 * 64 * 4 + 16 * 8 + packed.nbytes + 64 * 4
    model.proj.use(False)
    model.proj.dense(torch.float32)  # a dequantized copy kept beside the packed weight
    assert module_bytes(model) == 100 * 64 * 4 + 16 * 8 + packed.nbytes + 64 * 4 + 64 * 256 * 4


def test_a_block_matrix_counts_once_as_its_interleaved_copy_when_it_views_a_mapped_file() -> None:
    blocks = quantize(torch.randn(64, 256), "int8").parts[0]
    copy = torch.zeros(2 * blocks.data.numel(), dtype=torch.uint8)  # stands for the interleaved layout's bytes
    for mapped, expected in [(True, copy.numel()), (False, copy.numel() + blocks.data.numel())]:
        matrix = dataclasses.replace(blocks, interleaved=copy, mapped=mapped)
        model = nn.Module()
        model.proj = PackedLinear(PackedWeight([matrix]), None, RowChunking())
        assert module_bytes(model) == expected  # a mapped file's pages are handed back once interleaved
    model.proj = PackedLinear(PackedWeight([dataclasses.replace(blocks, mapped=True)]), None, RowChunking())
    assert module_bytes(model) == blocks.data.numel()  # read in place: its pages are the weight


def test_check_memory_names_every_need_when_they_do_not_fit() -> None:
    needs = [("the chat model's weights", 3 << 20), ("its KV pool", 1 << 20)]
    check_memory(4 << 20, needs)  # exactly fits
    with pytest.raises(MemoryBudgetError) as error:
        check_memory(4 << 20, [*needs, ("bge-small's weights", 1 << 19)])
    assert str(error.value).startswith(
        "not enough memory: the chat model's weights 3.0 MiB, its KV pool 1.0 MiB, bge-small's weights 0.5 MiB "
        "need 4.5 MiB together, but this server may use 4.0 MiB"
    )


def test_a_control_group_s_tightest_limit_caps_the_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cgroup v2: the process's group and its parents each leave their limit less their usage; "max" is none."""
    group = tmp_path / "parent" / "child"
    group.mkdir(parents=True)
    for folder, limit, usage in ((tmp_path, "max", 0), (tmp_path / "parent", "3000", 1000), (group, "max", 500)):
        (folder / "memory.max").write_text(f"{limit}\n")
        (folder / "memory.current").write_text(f"{usage}\n")
    assert host_memory._limits_left(tmp_path, "/parent/child", "memory.max", "memory.current") == [2000]
    assert host_memory._limits_left(tmp_path, "/", "memory.max", "memory.current") == []
    monkeypatch.setattr(host_memory, "_cgroup_headroom", lambda: 2000)
    assert host_memory.available_host_memory() == 2000
    monkeypatch.setattr(host_memory, "_cgroup_headroom", lambda: None)
    assert host_memory.available_host_memory() == host_memory._meminfo_available() > 0


def test_the_default_kv_pool_takes_a_quarter_of_available_memory_not_of_free_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Page cache (a model file just read) is reclaimable: the default CPU KV budget counts MemAvailable, so a warm
    page cache cannot shrink the pool to nothing; a control group's limit still caps it."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          100000 kB\nMemAvailable:   22000000 kB\n")
    monkeypatch.setattr(host_memory, "MEMINFO", meminfo)
    monkeypatch.setattr(host_memory, "_cgroup_headroom", lambda: None)
    cpu = torch.device("cpu")
    assert builder._kv_budget(EngineConfig(), cpu) == builder.DEFAULT_CPU_KV_BYTES  # 2 GiB < 22 GB / 4
    monkeypatch.setattr(host_memory, "_cgroup_headroom", lambda: 4 << 30)
    assert builder._kv_budget(EngineConfig(), cpu) == 1 << 30
    assert builder._kv_budget(EngineConfig(kv_cache_memory=12345), cpu) == 12345
