"""Which kernel library loads, what makes a built one unusable, and the source tree's run-time build: keyed by its
whole build.ninja, under a lock that dies with its holder, announced before it starts.

No compiler runs here: the run-time build is driven with a stand-in compiler that writes empty outputs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from statelm.kernels import build
from statelm.kernels.build import KernelBuildError, build_at_run_time, prebuilt_library
from statelm.kernels.ninja_build import MANIFEST, ninja_text, sources_digest
from statelm.kernels.variants import VARIANTS, by_name, select_variant
from statelm.process_lock import LockTimeout, process_lock

SAPPHIRE_RAPIDS = {"sse4_2", "sse4_1", "ssse3", "popcnt", "cx16", "lahf_lm", "avx", "avx2", "fma", "f16c", "bmi1",
                   "bmi2", "movbe", "abm", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni",
                   "avx512_bf16", "amx_tile"}  # fmt: skip
HASWELL = {"sse4_2", "sse4_1", "ssse3", "popcnt", "cx16", "lahf_lm", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
           "movbe", "abm"}  # fmt: skip


def test_the_best_class_the_cpu_runs_is_chosen_and_capped_by_aten_cpu_capability() -> None:
    assert select_variant(SAPPHIRE_RAPIDS).name == "avx512-vnni"
    assert select_variant(SAPPHIRE_RAPIDS - {"avx512_vnni"}).name == "avx512"
    assert select_variant(HASWELL).name == "avx2"
    assert select_variant(HASWELL - {"fma"}).name == "x86-64-v2"  # AVX2 without FMA: no AVX2 class
    assert select_variant({"sse2"}) is None
    assert select_variant(SAPPHIRE_RAPIDS, "avx512").name == "avx512"  # torch's avx512 class has no VNNI
    assert select_variant(SAPPHIRE_RAPIDS, "AVX2").name == "avx2"
    assert select_variant(SAPPHIRE_RAPIDS, "default").name == "x86-64-v2"
    assert select_variant(HASWELL, "avx512").name == "avx2"  # a cap never raises the class
    assert by_name("avx2").march == "haswell"
    assert len({variant.library_stem for variant in VARIANTS}) == len(VARIANTS)


@pytest.fixture
def library_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "lib"
    directory.mkdir()
    monkeypatch.setattr(build, "LIBRARY_DIR", directory)
    return directory


def write_manifest(directory: Path, torch_version: str, sources: str) -> Path:
    library = directory / "statelm_kernels_avx2.so"
    library.write_bytes(b"")
    manifest = {"torch": torch_version, "sources": sources, "libraries": {"avx2": library.name}}
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return library


def test_a_built_library_loads_only_for_its_torch_release_and_sources(library_dir: Path) -> None:
    avx2 = by_name("avx2")
    assert prebuilt_library(avx2)[0] is None and "not built" in prebuilt_library(avx2)[1]
    release = torch.__version__.split("+")[0]
    library = write_manifest(library_dir, f"{release}+cu130", sources_digest())  # another build of this release
    assert prebuilt_library(avx2) == (library, "")
    assert prebuilt_library(by_name("avx512")) == (None, f"{library_dir / MANIFEST} lists no library for avx512")
    write_manifest(library_dir, "2.1.0", sources_digest())
    path, reason = prebuilt_library(avx2)
    assert path is None and f"built against torch 2.1.0 and this is torch {torch.__version__}" in reason
    write_manifest(library_dir, torch.__version__, "0" * 64)
    path, reason = prebuilt_library(avx2)
    assert path is None and "older than their sources" in reason


MISMATCH_CHILD = """
import json, logging, sys
from pathlib import Path
from statelm.kernels import build
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
build.LIBRARY_DIR, build.SOURCE_TREE = Path(sys.argv[1]), False  # an installed package, no run-time build
print("available:", build.kernels_available(), build.kernels_available())
"""


def test_an_installed_package_built_for_another_torch_serves_on_the_torch_paths_with_one_line(
    library_dir: Path,
) -> None:
    write_manifest(library_dir, "2.1.0", sources_digest())
    child = subprocess.run(
        [sys.executable, "-c", MISMATCH_CHILD, str(library_dir)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    assert "available: False False" in child.stdout
    warnings = [line for line in child.stderr.splitlines() if line.startswith("WARNING statelm.kernels")]
    assert len(warnings) == 1, child.stderr  # one line, however often it is asked; nothing loaded
    assert "built against torch 2.1.0" in warnings[0] and "reinstall statelm" in warnings[0]
    assert "loading statelm's kernels" not in child.stderr


# Stands in for the compiler: writes the output (and its depfile) it is asked for, after $FAKE_CXX_SLEEP seconds.
FAKE_COMPILER = """#!/bin/sh
out=""; dep=""
while [ $# -gt 0 ]; do
  case "$1" in -o) out="$2"; shift;; -MF) dep="$2"; shift;; esac
  shift
done
echo "$out" >> "$FAKE_CXX_LOG"
sleep "${FAKE_CXX_SLEEP:-0}"
: > "$out"
if [ -n "$dep" ]; then echo "$out:" > "$dep"; fi
"""


@pytest.fixture
def fake_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in $CXX and a user cache of its own; returns the log of the outputs it was asked for."""
    compiler = tmp_path / "fake-c++"
    compiler.write_text(FAKE_COMPILER)
    compiler.chmod(compiler.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "compiler.log"
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("FAKE_CXX_LOG", str(log))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return log


def compiled(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_a_run_time_build_is_announced_keyed_by_its_build_file_and_done_once(
    fake_compiler: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    variant = by_name("avx2")
    with caplog.at_level(logging.INFO, logger="statelm.kernels.build"):
        library = build_at_run_time(variant)
    assert library.is_file() and str(tmp_path / "cache") in str(library)
    assert [r.getMessage() for r in caplog.records if "building statelm's kernels" in r.getMessage()] == [
        f"building statelm's kernels for avx2 (-march=haswell) into {library.parent} (about a minute, once)"
    ]
    assert any(name.endswith(".so") for name in compiled(fake_compiler))
    first = len(compiled(fake_compiler))
    caplog.clear()
    assert build_at_run_time(variant) == library  # built: nothing runs, nothing is announced
    assert len(compiled(fake_compiler)) == first and not caplog.records
    # the build file names the sources' paths and the compiler: another checkout or compiler is another build
    assert str(build.SOURCES_DIR) in ninja_text([variant], "/usr/bin/c++")
    assert ninja_text([variant], "/usr/bin/c++") != ninja_text([variant], "/usr/bin/clang++")


def test_a_run_time_build_waits_a_bounded_time_for_another_and_names_it(
    fake_compiler: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    builder = start_builder(tmp_path, sleep=60)
    try:
        monkeypatch.setattr(build, "BUILD_WAIT_S", 1.0)
        with caplog.at_level(logging.INFO), pytest.raises(KernelBuildError) as error:
            build_at_run_time(by_name("avx2"))
        assert f"process {builder.pid} on" in str(error.value) and "gave up after 1s waiting for" in str(error.value)
        waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
        assert len(waiting) == 1 and f"process {builder.pid}" in waiting[0] and "builds statelm's kernels" in waiting[0]
    finally:
        builder.kill()
        builder.wait()


def test_a_build_killed_midway_leaves_no_lock_and_the_next_start_builds(
    fake_compiler: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builder = start_builder(tmp_path, sleep=60)
    os.kill(builder.pid, signal.SIGKILL)
    builder.wait()
    monkeypatch.setattr(build, "BUILD_WAIT_S", 5.0)  # would time out if the dead builder still held anything
    started = time.monotonic()
    library = build_at_run_time(by_name("avx2"))
    assert library.is_file() and time.monotonic() - started < 5


BUILDER_CHILD = """
from statelm.kernels.build import build_at_run_time
from statelm.kernels.variants import by_name
build_at_run_time(by_name("avx2"))
"""


def start_builder(tmp_path: Path, sleep: float) -> subprocess.Popen[bytes]:
    """A process in the middle of a run-time build (its stand-in compiler sleeping), holding the build's lock."""
    env = {**os.environ, "FAKE_CXX_SLEEP": str(sleep)}
    builder = subprocess.Popen([sys.executable, "-c", BUILDER_CHILD], env=env)
    deadline = time.monotonic() + 60
    while not (tmp_path / "compiler.log").exists():  # the compiler runs: the lock is held
        assert builder.poll() is None and time.monotonic() < deadline, "the builder did not start compiling"
        time.sleep(0.05)
    return builder


def test_a_process_lock_dies_with_its_holder(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import time
            from pathlib import Path
            from statelm.process_lock import process_lock
            with process_lock(Path({str(path)!r}), "holds", 60):
                print("held", flush=True)
                time.sleep(60)
            """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    expected = f"gave up after 0.3s waiting for process {holder.pid} on .*, which writes x"
    with pytest.raises(LockTimeout, match=expected), process_lock(path, "writes x", 0.3):
        pass
    holder.kill()
    holder.wait()
    with process_lock(path, "writes x", 1.0):
        assert f"process {os.getpid()} on" in path.read_text()
