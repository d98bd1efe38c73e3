"""What a run leaves on disk, written so that a crash never leaves a half-written file behind.

Every file is written to a temporary name in the same folder and renamed into place: a rename
within one file system is atomic, so readers (and a resumed run) see the old file or the new one,
never a torn one.  ``result.json`` is written last, so its presence means the run finished.
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
WEIGHTS_FILE = "trainable.safetensors"
CHECKPOINT_FILE = "checkpoint.pt"
RUN_FILES = (CONFIG_FILE, METRICS_FILE, RESULT_FILE, WEIGHTS_FILE, CHECKPOINT_FILE)

VERSIONED_PACKAGES = ("petl", "torch", "torchvision", "timm", "accelerate", "peft", "hydra-core", "omegaconf", "numpy")


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp creates the file private (0600); give it the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` and move the result onto ``path`` atomically."""
    with atomic_path(path) as tmp:
        write(tmp)


def write_text(path: Path, text: str) -> None:
    """Write a text file atomically (flushed to disk before the rename)."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    write_atomic(path, write)


def write_json(path: Path, record: dict[str, Any]) -> None:
    """Write a JSON record atomically."""
    write_text(path, json.dumps(record, indent=2, sort_keys=False, default=str) + "\n")


def write_metrics(path: Path, history: list[dict[str, Any]]) -> None:
    """Rewrite ``metrics.jsonl`` with one line per finished epoch."""
    write_text(path, "".join(json.dumps(row) + "\n" for row in history))


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    """Append one epoch's line (after its checkpoint is safe: a resume rewrites the file from it)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON record, or ``None`` when the file does not exist."""
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def rng_state() -> dict[str, Any]:
    """Every random generator a training step may draw from, as tensors and plain values."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # Stored as tensors and ints so the checkpoint loads with torch.load(weights_only=True).
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state["python"])
    name, key, *rest = state["numpy"]
    np.random.set_state((name, key.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write a checkpoint atomically (trainable weights, optimizer, scheduler, RNG, history)."""
    write_atomic(path, lambda tmp: torch.save(state, tmp))


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """A checkpoint written by :func:`save_checkpoint`, or ``None``; never unpickles arbitrary objects."""
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


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


def peak_memory() -> tuple[float, str]:
    """Peak memory in MiB and what it measures: CUDA max allocated on GPU, else the process's max RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20, "cuda_max_allocated"
    # Linux reports ru_maxrss in KiB (macOS in bytes).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    divisor = 2**20 if platform.system() == "Darwin" else 2**10
    return rss / divisor, "process_max_rss"
