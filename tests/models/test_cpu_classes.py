"""The invariance and exactness tests again, with torch's and statelm's vector kernels capped at lower CPU classes.

On an AVX-512 or AMX machine this shows what an AVX2-only CPU (and one without AVX) computes; on an AVX2
machine the AVX2 run is the suite itself, and only the scalar class runs here. Tests marked `invariance`
run in a child pytest with ATEN_CPU_CAPABILITY (torch's kernels and the class of statelm's library it loads) and
ONEDNN_MAX_CPU_ISA set. Under the AVX2 cap: every kernel-level one (tests/unit: each kernel family in each of its
dtypes and KV formats), the model-level probes and fused decoder layers, and the default model's engine-level
invariance and session exactness in two of its configurations, the default (float16 KV) and llama.cpp's arithmetic
(int8 activations): the float32, bfloat16 and q8_0 KV caches run kernels the kernel-level tests already check under
the cap, and the suite itself runs them at the engine level on the machine's own class. Under the scalar cap: the
kernel-level ones (the engine-level ones would take minutes of scalar arithmetic).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CLASS_ORDER = {"default": 0, "avx2": 1, "avx512": 2}
ONEDNN_ISA = {"avx2": "AVX2", "default": "SSE41"}
MODEL_LEVEL = [f"tests/models/test_{name}.py" for name in ("invariance", "fused_decoder", "session_engine")]
# tests/unit's modules with invariance tests: the child collects only those (collecting them all costs seconds)
KERNEL_LEVEL = sorted(
    str(path.relative_to(ROOT))
    for path in (ROOT / "tests" / "unit").glob("test_*.py")
    if "mark.invariance" in path.read_text()
)
SELECTION = {  # pytest arguments of the child run, by cap (see the module docstring)
    "avx2": [  # the engine's follow-up and refresh logic is the same on every class
        *KERNEL_LEVEL,
        *MODEL_LEVEL,
        "-k",
        "not float32-kv and not bfloat16-kv and not q8_0-kv and not follow_up and not reply_refresh",
    ],
    "default": KERNEL_LEVEL,
}


def native_class() -> str:
    """The class torch runs at on this machine without a cap."""
    return torch.backends.cpu.get_cpu_capability().lower()


def selected_classes(session: pytest.Session) -> set[str]:
    """The capped classes this run's selection asks for that lie below this machine's own."""
    test = test_invariance_holds_under_a_capped_cpu_class.__name__
    asked = {item.callspec.params["capability"] for item in session.items if item.originalname == test}
    return {name for name in asked if CLASS_ORDER[name] < CLASS_ORDER.get(native_class(), 0)}


@pytest.fixture(scope="module")
def capped_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], Path]]]:
    """The child pytest of each selected capped class, all started at once (their imports, collection and
    single-row arithmetic leave a core free): each process with the file its output goes to."""
    runs = {}
    for capability in sorted(selected_classes(request.session)):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[capability]}
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "invariance", *SELECTION[capability]]
        output = tmp_path_factory.mktemp("capped") / f"{capability}.log"
        with output.open("wb") as sink:
            runs[capability] = (
                subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT),
                output,
            )
    yield runs
    for process, _ in runs.values():
        process.kill()
        process.wait()


@pytest.mark.parametrize("capability", list(ONEDNN_ISA))
def test_invariance_holds_under_a_capped_cpu_class(
    capability: str, capped_runs: dict[str, tuple[subprocess.Popen[bytes], Path]]
) -> None:
    if capability not in capped_runs:
        pytest.skip(f"this machine computes at {native_class()}; the suite itself covers that class")
    process, output_path = capped_runs[capability]
    returncode = process.wait(timeout=900)
    output = output_path.read_text()
    assert f"capped by ATEN_CPU_CAPABILITY={capability}" in output
    assert returncode == 0, output[-6000:]
    assert " passed" in output
