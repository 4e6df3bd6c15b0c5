"""The single-process server never imports Ray (an optional extra, heavy to import)."""

from __future__ import annotations

import subprocess
import sys


def test_statelm_serve_import_path_imports_no_ray() -> None:
    code = (
        "import sys, statelm.cli.main, statelm.server.launch, statelm.server.app;"
        "loaded = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'));"
        "print(loaded); sys.exit(1 if loaded else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
