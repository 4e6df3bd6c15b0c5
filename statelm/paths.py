"""Where statelm keeps its state on disk: sessions, snapshots, server logs and pid files."""

from __future__ import annotations

from pathlib import Path

import platformdirs

APP_NAME = "statelm"


def default_state_dir() -> Path:
    """The per-user state directory (for example ~/.local/state/statelm on Linux)."""
    return Path(platformdirs.user_state_dir(APP_NAME))
