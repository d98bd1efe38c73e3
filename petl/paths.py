"""Where petl keeps what it makes once per user: converted weights, unpacked datasets."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CACHE_ENV = "PETL_CACHE_DIR"


def cache_dir() -> Path:
    """The cache folder: ``$PETL_CACHE_DIR``, else ``$XDG_CACHE_HOME/petl``, else ``~/.cache/petl``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "petl"


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()
