"""Suite-wide: the CPU class the run computes on, shown in pytest's header."""

from __future__ import annotations

import os

from statelm import cpu
from statelm.kernels.build import target_march


def pytest_report_header() -> list[str]:
    """Which CPU class torch's and statelm's kernels run at (capped by ATEN_CPU_CAPABILITY or not)."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    capped = f", capped by ATEN_CPU_CAPABILITY={cap}" if cap else ""
    return [f"cpu: {cpu.describe()}; statelm kernels -march={target_march()}{capped}"]
