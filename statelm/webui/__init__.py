"""The web UI's built files (from webui/ at the repository root, by `make webui`), shipped in the wheel."""

from pathlib import Path

DIST = Path(__file__).parent / "dist"
