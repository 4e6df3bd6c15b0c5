"""Load the C++ kernels as torch ops: the library built for the best CPU class this CPU runs.

The libraries are compiled when the package is built (setup.py: the wheel, `pip install -e .`, `make`), one per
class of statelm/kernels/variants.py, into statelm/kernels/lib with kernels.json saying which torch and which
sources they were built from. A start loads one and never compiles, with one exception: a source tree whose
libraries are missing or stale (no build step ran, or csrc/ changed since, or another torch is installed) builds
its class once into the user cache, keyed by the whole build.ninja, under a lock that dies with its holder.
An installed package whose libraries do not fit the torch it runs with falls back to the torch paths.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import platformdirs
import torch

from statelm.cpu import cpu_flags
from statelm.kernels.ninja_build import (
    MANIFEST,
    SOURCES_DIR,
    KernelCompileError,
    find_compiler,
    library_name,
    ninja_text,
    run_ninja,
    sources_digest,
    write_build,
)
from statelm.kernels.variants import Variant, select_variant
from statelm.paths import APP_NAME
from statelm.process_lock import LockTimeout, process_lock

log = logging.getLogger(__name__)

LIBRARY_DIR = Path(__file__).parent / "lib"
# a checkout (setup.py beside the package) may build at run time; an installed package never does
SOURCE_TREE = (Path(__file__).resolve().parents[2] / "setup.py").is_file()
BUILD_WAIT_S = 600.0  # how long a start waits for another process's build of the same kernels
_BUILT = "built"  # written into a run-time build's directory once its library is complete
_lock = threading.Lock()
_loaded: bool | None = None
_error: str | None = None
_library: Path | None = None
_reported = False  # whether kernels_available() logged why they are not


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded."""


def cpu_variant() -> Variant | None:
    """The CPU class whose library loads here: the best this CPU runs, capped by ATEN_CPU_CAPABILITY."""
    return select_variant(cpu_flags(), os.environ.get("ATEN_CPU_CAPABILITY"))


def target_march() -> str:
    """The -march of the kernels that load here: the CPU's class, or the one ATEN_CPU_CAPABILITY caps them at."""
    variant = cpu_variant()
    return variant.march if variant else "none"


def loaded_library() -> Path | None:
    """The library the kernels were loaded from, if they were."""
    return _library


def load_kernels(verbose: bool = False) -> None:
    """Load the kernels (a source tree without a build step builds them first); raises KernelBuildError with the
    reason when that fails. verbose: show the compiler's progress when a source tree builds them."""
    global _loaded, _error
    with _lock:
        if _loaded:
            return
        if _loaded is False:
            raise KernelBuildError(_error or "unknown error")
        try:
            _load(verbose)
        except Exception as exc:  # no library, a stale one, compiler missing, compile or load error: "no kernels"
            _loaded, _error = False, str(exc) if isinstance(exc, KernelBuildError) else f"{type(exc).__name__}: {exc}"
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
    """Whether the kernels are loaded (loading them on first call); logs the reason the first time they are not."""
    global _reported
    try:
        load_kernels()
    except KernelBuildError as exc:
        if not _reported:
            log.warning("statelm C++ kernels unavailable, using the torch reference path: %s", exc)
            _reported = True
        return False
    return True


def prebuilt_library(variant: Variant) -> tuple[Path | None, str]:
    """The built library of a class if it fits this torch and these sources, else None and the reason."""
    try:
        manifest = json.loads((LIBRARY_DIR / MANIFEST).read_text())
        built_torch, built_sources, libraries = manifest["torch"], manifest["sources"], manifest["libraries"]
    except FileNotFoundError:
        return None, f"statelm's kernels were not built ({LIBRARY_DIR / MANIFEST} is missing)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{LIBRARY_DIR / MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    # CPU and CUDA builds of one torch release share libtorch_cpu's ABI; another release may not
    if built_torch.split("+")[0] != torch.__version__.split("+")[0]:
        return None, (
            f"statelm's kernels were built against torch {built_torch} and this is torch {torch.__version__}"
            " (reinstall statelm for this torch)"
        )
    if SOURCES_DIR.is_dir() and built_sources != sources_digest():
        return None, f"statelm's kernels in {LIBRARY_DIR} are older than their sources in {SOURCES_DIR}"
    if not isinstance(libraries, dict) or not isinstance(libraries.get(variant.name), str):
        return None, f"{LIBRARY_DIR / MANIFEST} lists no library for {variant.name}"
    library = LIBRARY_DIR / libraries[variant.name]
    if not library.is_file():
        return None, f"{library} is missing"
    return library, ""


def _load(verbose: bool) -> None:
    global _library
    variant = cpu_variant()
    if variant is None:
        raise KernelBuildError("this CPU runs none of the classes the kernels are built for (x86-64-v2 and up)")
    library, reason = prebuilt_library(variant)
    if library is None:
        if not SOURCE_TREE:
            raise KernelBuildError(reason)
        log.info("%s: this source tree builds them itself", reason)
        library = build_at_run_time(variant, verbose)
    log.info("loading statelm's kernels for %s (-march=%s) from %s", variant.name, variant.march, library)
    torch.ops.load_library(str(library))
    _library = library


def build_at_run_time(variant: Variant, verbose: bool = False) -> Path:
    """Build a class's library into the user cache (once per build.ninja and sources), under a process lock."""
    try:
        compiler = find_compiler()
        text = ninja_text([variant], compiler)
    except KernelCompileError as exc:
        raise KernelBuildError(str(exc)) from None
    key = hashlib.sha256(f"{text}\0{sources_digest()}".encode()).hexdigest()[:16]
    directory = Path(platformdirs.user_cache_dir(APP_NAME)) / "kernels" / key
    library = directory / library_name(variant)
    if (directory / _BUILT).is_file():
        return library
    purpose = f"builds statelm's kernels in {directory}"
    try:
        with process_lock(directory.with_name(f"{key}.lock"), purpose, BUILD_WAIT_S):
            if not (directory / _BUILT).is_file():  # else another process built them while this one waited
                log.info(
                    "building statelm's kernels for %s (-march=%s) into %s (about a minute, once)",
                    variant.name,
                    variant.march,
                    directory,
                )
                write_build(directory, [variant], compiler)
                run_ninja(directory, echo=verbose)
                (directory / _BUILT).write_text(text)
    except (KernelCompileError, LockTimeout) as exc:
        raise KernelBuildError(str(exc)) from None
    return library


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        load_kernels(verbose=True)
    except KernelBuildError as exc:
        raise SystemExit(f"statelm: no C++ kernels: {exc}") from None
    print(f"statelm kernels (-march={target_march()}) loaded from {loaded_library()}")
