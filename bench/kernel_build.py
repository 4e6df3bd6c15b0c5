"""How long the kernels' build takes: every CPU class from scratch, as setup.py builds it, and without the
precompiled torch headers for comparison.

Usage: .venv/bin/python -m bench.kernel_build [--jobs 2] [--no-compare]
Each build runs `ninja -j JOBS` in a fresh temporary directory; CPU time (user + sys of the compilers) moves
less with other work on the machine than wall time, so both are printed, with the load average at the start.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import machine_report
from statelm.kernels.ninja_build import find_compiler, find_ninja, write_build
from statelm.kernels.variants import VARIANTS


def without_precompiled_headers(directory: Path) -> None:
    """Rewrite directory's build.ninja so that sources parse torch's headers themselves."""
    path = directory / "build.ninja"
    text = path.read_text().replace(" -Winvalid-pch -include $headers", "")
    text = re.sub(r"^build \S+\.gch: headers .*\n  march = .*\n", "", text, flags=re.MULTILINE)
    path.write_text(re.sub(r"^(build \S+\.o: compile \S+) \| \S+$", r"\1", text, flags=re.MULTILINE))


def timed_build(precompiled: bool, jobs: int) -> tuple[float, float]:
    """Wall and CPU seconds of one build of every class from scratch."""
    with tempfile.TemporaryDirectory(prefix="statelm-kernel-build-") as tmp:
        directory = Path(tmp)
        write_build(directory, VARIANTS, find_compiler())
        if not precompiled:
            without_precompiled_headers(directory)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        subprocess.run([find_ninja(), "-C", str(directory), "-j", str(jobs)], check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--no-compare", action="store_true", help="time the build with precompiled headers only")
    args = parser.parse_args()
    print(machine_report())
    print(f"classes: {', '.join(v.name for v in VARIANTS)}; ninja -j {args.jobs}")
    for precompiled in (True,) if args.no_compare else (True, False):
        load = " ".join(f"{value:.1f}" for value in os.getloadavg())
        wall, cpu = timed_build(precompiled, args.jobs)
        label = "precompiled torch headers" if precompiled else "no precompiled headers"
        print(f"{label:26s}: {cpu:6.0f} s CPU, {wall:6.0f} s wall (load average {load} at the start)")


if __name__ == "__main__":
    main()
