"""The start-up memory check: what a model's weights take, what a control group leaves, and the error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from statelm.kernels.quant import quantize
from statelm.models.layers import RowChunking
from statelm.models.packed import PackedLinear
from statelm.server import memory_budget
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
    assert memory_budget._limits_left(tmp_path, "/parent/child", "memory.max", "memory.current") == [2000]
    assert memory_budget._limits_left(tmp_path, "/", "memory.max", "memory.current") == []
    monkeypatch.setattr(memory_budget, "_cgroup_headroom", lambda: 2000)
    assert memory_budget.available_host_memory() == 2000
    monkeypatch.setattr(memory_budget, "_cgroup_headroom", lambda: None)
    assert memory_budget.available_host_memory() == memory_budget._meminfo_available() > 0
