"""The invariance and exactness tests again, with torch's and statelm's vector kernels capped at lower CPU classes.

On an AVX-512 or AMX machine this shows what an AVX2-only CPU (and one without AVX) computes; on an AVX2
machine the AVX2 run is the suite itself, and only the scalar class runs here. Tests marked `invariance`
run in a child pytest with ATEN_CPU_CAPABILITY (torch's kernels and the class of statelm's library it loads) and
ONEDNN_MAX_CPU_ISA set: all of them under the AVX2 cap; under the scalar cap, the kernel-level ones in
tests/unit (the engine-level ones would take minutes of scalar arithmetic).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CLASS_ORDER = {"default": 0, "avx2": 1, "avx512": 2}
ONEDNN_ISA = {"avx2": "AVX2", "default": "SSE41"}


def native_class() -> str:
    """The class torch runs at on this machine without a cap."""
    return torch.backends.cpu.get_cpu_capability().lower()


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_invariance_holds_under_a_capped_cpu_class(capability: str) -> None:
    if CLASS_ORDER[capability] >= CLASS_ORDER.get(native_class(), 0):
        pytest.skip(f"this machine computes at {native_class()}; the suite itself covers that class")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[capability]}
    paths = ["tests/unit", "tests/models"] if capability == "avx2" else ["tests/unit"]
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "invariance", *paths]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert f"capped by ATEN_CPU_CAPABILITY={capability}" in output
    assert result.returncode == 0, output[-6000:]
    assert " passed" in output
