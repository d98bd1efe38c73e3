"""What code ran: the installed versions that decide a result and the petl checkout's commit (a run's record
and a pretraining's provenance both hold them).
"""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

VERSIONED_PACKAGES = ("petl", "torch", "torchvision", "timm", "accelerate", "peft", "hydra-core", "omegaconf", "numpy")


def versions() -> dict[str, str | None]:
    """Installed versions of Python and the libraries that decide a result."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in VERSIONED_PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    # The build tag (+cu130, +cpu) tells which binary ran; only the module knows it.
    found["torch"] = torch.__version__
    return found


def git_commit() -> dict[str, Any]:
    """The commit (and whether the tree had changes) of the petl checkout, when it is one."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": bool(dirty) if dirty is not None else None}
