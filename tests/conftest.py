"""Suite-wide: the CPU class the run computes on, shown in pytest's header, and a model cache of the run's own."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from statelm import cpu
from statelm.kernels.build import target_march
from statelm.models.model_cache import CACHE_DIR_ENV

_RUN_CACHE = pytest.StashKey[str]()


def pytest_report_header() -> list[str]:
    """Which CPU class torch's and statelm's kernels run at (capped by ATEN_CPU_CAPABILITY or not)."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    capped = f", capped by ATEN_CPU_CAPABILITY={cap}" if cap else ""
    return [f"cpu: {cpu.describe()}; statelm kernels -march={target_march()}{capped}"]


def pytest_configure(config: pytest.Config) -> None:
    """Point the model cache (and every server the tests start) at a directory of this run, so that the models the
    tests write never land in the user's cache; it goes when the run ends."""
    config.stash[_RUN_CACHE] = os.environ[CACHE_DIR_ENV] = tempfile.mkdtemp(prefix="statelm-test-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the run's model cache."""
    if _RUN_CACHE in config.stash:
        shutil.rmtree(config.stash[_RUN_CACHE], ignore_errors=True)
