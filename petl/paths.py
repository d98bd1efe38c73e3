"""Where petl keeps what it makes once per user: converted weights, unpacked datasets."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PETL_CACHE_DIR"


def cache_dir() -> Path:
    """The cache folder: ``$PETL_CACHE_DIR``, else ``$XDG_CACHE_HOME/petl``, else ``~/.cache/petl``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "petl"
