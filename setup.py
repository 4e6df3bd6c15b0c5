"""Builds statelm's C++ kernels with the package: one library per CPU class (statelm/kernels/variants.py).

Everything else about the package is in pyproject.toml. The libraries land in statelm/kernels/lib/ (in the wheel,
or in the source tree for `pip install -e .` and `python setup.py build_ext --inplace`, which `make` runs), with
kernels.json recording the torch version and the sources they were built from; the server loads the best one the
CPU supports and never compiles at start.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from statelm.kernels.ninja_build import (  # noqa: E402  (the package is not installed yet)
    MANIFEST,
    SOURCES_DIR,
    KernelCompileError,
    find_compiler,
    library_name,
    run_ninja,
    write_build,
    write_manifest,
)
from statelm.kernels.variants import VARIANTS  # noqa: E402

PACKAGE = "statelm.kernels.lib"
# the kernels have vector paths for x86 only; elsewhere the package installs without them and the torch paths serve
VARIANTS_BUILT = VARIANTS if platform.machine().lower() in ("x86_64", "amd64") else ()


class BuildKernels(build_ext):
    """Compiles every class's library in one ninja build (kept in build/kernels, so a rebuild compiles only what
    changed), then puts the libraries and their kernels.json where setuptools expects them."""

    def run(self) -> None:
        self.in_source = self.inplace  # setuptools builds into build_lib first, with inplace turned off
        super().run()

    def build_extensions(self) -> None:
        try:
            compiler = find_compiler()
        except KernelCompileError as exc:
            if not self.in_source:
                raise  # a wheel without its kernels would be a slower package that looks like the real one
            print(f"statelm: {exc}; the kernels are not built and the torch paths will serve", file=sys.stderr)
            return
        directory = ROOT / "build" / "kernels"
        write_build(directory, VARIANTS_BUILT, compiler)
        run_ninja(directory, echo=True)
        built = self.built_dir()
        built.mkdir(parents=True, exist_ok=True)
        libraries = {}
        for extension, variant in zip(self.extensions, VARIANTS_BUILT, strict=True):
            name = Path(self.get_ext_filename(self.get_ext_fullname(extension.name))).name
            install_file(directory / library_name(variant), built / name)
            libraries[variant.name] = name
        write_manifest(built, libraries)

    def built_dir(self) -> Path:
        """Where the libraries go in the build tree (the wheel's contents)."""
        return Path(self.build_lib, *PACKAGE.split("."))

    def copy_extensions_to_source(self) -> None:
        """For `--inplace` and `pip install -e .`: the libraries, then kernels.json, into the source tree."""
        built = self.built_dir()
        if not (built / MANIFEST).is_file():
            return  # not built (no compiler)
        source = Path(self.get_finalized_command("build_py").get_package_dir(PACKAGE))
        source.mkdir(exist_ok=True)
        for path in sorted(built.glob("*.so")):
            install_file(path, source / path.name)
        install_file(built / MANIFEST, source / MANIFEST)  # last: it says which libraries are there


def install_file(source: Path, target: Path) -> None:
    """Copy source to target by renaming a new file over it: a server running from there keeps the library it
    mapped (overwriting that file in place would crash it)."""
    staged = target.with_name(f".{target.name}.{os.getpid()}")
    shutil.copyfile(source, staged)
    staged.replace(target)


def relative(path: Path) -> str:
    """A path relative to setup.py, as setuptools wants sources."""
    return str(path.relative_to(ROOT))


files = sorted(SOURCES_DIR.iterdir())
extensions = [
    Extension(
        f"{PACKAGE}.{variant.library_stem}",
        sources=[relative(path) for path in files if path.suffix == ".cpp"],
        depends=[relative(path) for path in files if path.suffix != ".cpp"],
    )
    for variant in VARIANTS_BUILT
]

setup(ext_modules=extensions, cmdclass={"build_ext": BuildKernels})
