"""Compile the C++ kernels in csrc/ with the system compiler once per machine and load them as torch ops.

The build is cached under the user cache directory, keyed by the sources, the torch version, the CPU's
instruction-set flags and the target (-march=native unless ATEN_CPU_CAPABILITY caps it), so a build never
crosses CPU classes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import platformdirs
import torch

from statelm.cpu import cpu_flags
from statelm.paths import APP_NAME

log = logging.getLogger(__name__)

SOURCES_DIR = Path(__file__).parent / "csrc"
_lock = threading.Lock()
_loaded: bool | None = None
_error: str | None = None


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded."""


# ATEN_CPU_CAPABILITY caps torch's own vector kernels; the same variable caps statelm's, so that one setting
# shows on an AVX-512 or AMX machine what an AVX2-only or a pre-AVX CPU computes.
MARCH_BY_CAPABILITY = {"default": "x86-64-v2", "avx2": "haswell"}


def target_march() -> str:
    """The -march the kernels are built for: the host CPU, or the class ATEN_CPU_CAPABILITY caps them at."""
    return MARCH_BY_CAPABILITY.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower(), "native")


def _build_key() -> str:
    digest = hashlib.sha256()
    for source in sorted(SOURCES_DIR.glob("*")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    digest.update(target_march().encode())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """Where this machine's build of the current sources lives."""
    return Path(platformdirs.user_cache_dir(APP_NAME)) / "kernels" / _build_key()


def load_kernels(verbose: bool = False) -> None:
    """Build (first time) and load the kernels; raises KernelBuildError with the reason when that fails."""
    global _loaded, _error
    with _lock:
        if _loaded:
            return
        if _loaded is False:
            raise KernelBuildError(_error or "unknown error")
        try:
            _build_and_load(verbose)
        except Exception as exc:  # compiler missing, compile error, load error: all mean "no kernels"
            _loaded, _error = False, f"{type(exc).__name__}: {exc}"
            raise KernelBuildError(_error) from exc
        _loaded = True


def use_kernel_threads() -> int:
    """Give statelm's kernels torch's intra-op threads and leave torch's own ops on the calling thread; returns
    the kernels' thread count.

    Two thread pools on the same cores fight: torch's OpenMP workers spin after each small torch op of a step
    and take the core a kernel's worker needs (39% of a prefill profile was libgomp spinning). On the kernels
    path torch's ops are small, so they run on the engine thread and the kernels own the cores.
    """
    load_kernels()
    threads = torch.get_num_threads()
    if threads > 1:
        torch.ops.statelm.set_num_threads(threads)
        torch.set_num_threads(1)
    return int(torch.ops.statelm.get_num_threads())


def kernels_available() -> bool:
    """Whether the kernels are loaded (building them on first call); logs the reason once when not."""
    try:
        load_kernels()
    except KernelBuildError as exc:
        log.warning("statelm C++ kernels unavailable, using the torch reference path: %s", exc)
        return False
    return True


def _build_and_load(verbose: bool) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler found ({compiler!r} is not on PATH); install g++ to build them")
    target = build_dir()
    target.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(path) for path in SOURCES_DIR.glob("*.cpp"))
    if not (target / "statelm_kernels.so").exists():
        log.info("building statelm's C++ kernels for -march=%s into %s (once per machine)", target_march(), target)
    cpp_extension.load(
        name="statelm_kernels",
        sources=sources,
        # -fopenmp: without it at::parallel_for compiles to a serial loop; libgomp.so.1 resolves to torch's own copy
        extra_cflags=["-O3", f"-march={target_march()}", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(target),
        is_python_module=False,
        verbose=verbose,
    )


if __name__ == "__main__":
    try:
        load_kernels()
    except KernelBuildError as exc:
        raise SystemExit(f"statelm: cannot build the C++ kernels: {exc}") from None
    print(f"statelm kernels (-march={target_march()}) ready in {build_dir()}")
