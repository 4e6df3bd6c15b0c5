"""The kernels' build: one ninja file that compiles every csrc/*.cpp once per CPU class and links a library each.

setup.py runs it for every class when the package is built (wheel, `pip install -e .`, `make`); the run-time
fallback of a source tree without a build step runs it for one class. Each class precompiles torch's headers
once (they are most of a source file's compile time) and its sources include that header first.

Needs torch (for its headers and libraries) and the standard library only: setup.py imports it in the build
environment, before statelm's own dependencies are installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from statelm.kernels.variants import Variant

SOURCES_DIR = Path(__file__).parent / "csrc"
MANIFEST = "kernels.json"
# -fopenmp: without it at::parallel_for compiles to a serial loop; libgomp.so.1 resolves to torch's own copy.
# -ffp-contract=off: no fused multiply-adds the source does not write, so every class rounds alike.
OPTIMIZE = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
TORCH_HEADERS = "torch_headers.h"
TORCH_HEADERS_TEXT = "#include <ATen/ATen.h>\n#include <ATen/Parallel.h>\n#include <torch/library.h>\n"


class KernelCompileError(RuntimeError):
    """The compiler or ninja is missing, or the build failed (the message ends with the compiler's output)."""


def source_files() -> list[Path]:
    """Every file of csrc/ (sources and headers), in name order."""
    return sorted(path for path in SOURCES_DIR.iterdir() if path.is_file())


def sources_digest() -> str:
    """A hash of csrc/'s file names and contents: what a built library was compiled from."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def find_compiler() -> str:
    """The C++ compiler's absolute path ($CXX, else c++), or KernelCompileError."""
    compiler = os.environ.get("CXX", "c++")
    found = shutil.which(compiler)
    if found is None:
        raise KernelCompileError(f"no C++ compiler found ({compiler!r} is not on PATH); install g++ to build them")
    return found


def find_ninja() -> str:
    """The ninja executable of the `ninja` package, else the one on PATH, or KernelCompileError."""
    try:
        import ninja

        bundled = Path(ninja.BIN_DIR) / "ninja"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("ninja")
    if found is None:
        raise KernelCompileError("ninja is not installed (pip install ninja)")
    return found


def library_name(variant: Variant) -> str:
    """The file a class's library is linked to in the build directory."""
    return f"{variant.library_stem}.so"


def ninja_text(variants: Iterable[Variant], compiler: str) -> str:
    """The build.ninja that compiles and links the given classes: every path, flag and version it depends on."""
    import torch
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    cflags = [
        "-DTORCH_EXTENSION_NAME=statelm_kernels",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-isystem {path}" for path in includes),
        "-fPIC",
        "-std=c++20",
        *OPTIMIZE,
        # GCC 12 reads the reference counts torch's headers inline into a custom class's boxed constructor
        # (decoder.cpp's PreparedLayers) as writes past an object: false positives, past any pragma's reach
        "-Wno-stringop-overflow",
    ]
    ldflags = [
        "-shared",
        "-fopenmp",
        *(f"-L{path}" for path in cpp_extension.library_paths()),
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        "-ltorch_python",
    ]
    lines = [
        "ninja_required_version = 1.3",
        f"# torch {torch.__version__} at {Path(torch.__file__).parent}; python {sys.version.split()[0]}",
        f"cxx = {compiler}",
        f"cflags = {' '.join(cflags)}",
        f"ldflags = {' '.join(ldflags)}",
        "",
        # -MD, not -MMD: torch's headers are dependencies too, so a new torch rebuilds everything
        "rule headers",
        "  command = $cxx -MD -MF $out.d $cflags $march -x c++-header $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = precompiling torch's headers for $march",
        "rule compile",
        "  command = $cxx -MD -MF $out.d $cflags $march -Winvalid-pch -include $headers -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compiling $in for $march",
        "rule link",
        "  command = $cxx $in $ldflags -o $out",
        "  description = linking $out",
    ]
    sources = [path for path in source_files() if path.suffix == ".cpp"]
    for variant in variants:
        march = f"-march={variant.march}"
        headers = f"{variant.name}/{TORCH_HEADERS}"
        lines += ["", f"build {headers}.gch: headers {headers}", f"  march = {march}"]
        objects = []
        for source in sources:
            obj = f"{variant.name}/{source.stem}.o"
            objects.append(obj)
            lines += [f"build {obj}: compile {source} | {headers}.gch", f"  march = {march}", f"  headers = {headers}"]
        lines.append(f"build {library_name(variant)}: link {' '.join(objects)}")
    return "\n".join(lines) + "\n"


def write_build(directory: Path, variants: Iterable[Variant], compiler: str) -> None:
    """Write build.ninja and the header each class precompiles into directory (only what changed)."""
    variants = list(variants)
    directory.mkdir(parents=True, exist_ok=True)
    for variant in variants:
        (directory / variant.name).mkdir(exist_ok=True)
        _write_if_changed(directory / variant.name / TORCH_HEADERS, TORCH_HEADERS_TEXT)
    _write_if_changed(directory / "build.ninja", ninja_text(variants, compiler))


def run_ninja(directory: Path, echo: bool = False) -> None:
    """Build what directory's build.ninja describes; echo: show ninja's progress as it goes."""
    command = [find_ninja(), "-C", str(directory)]
    if jobs := os.environ.get("MAX_JOBS"):
        command += ["-j", jobs]
    if echo:
        result = subprocess.run(command)
        output = ""
    else:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = result.stdout
    if result.returncode != 0:
        raise KernelCompileError(f"ninja failed in {directory} (exit {result.returncode})\n{output[-4000:]}")


def write_manifest(directory: Path, libraries: dict[str, str]) -> None:
    """Record what the libraries in directory were built from: torch's version and the sources' hash."""
    import torch

    manifest = {"torch": torch.__version__, "sources": sources_digest(), "libraries": libraries}
    _write_if_changed(directory / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def _write_if_changed(path: Path, text: str) -> None:
    # an unchanged file keeps its mtime, so ninja and make see nothing new
    if not path.exists() or path.read_text() != text:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
