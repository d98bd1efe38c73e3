"""What a run leaves on disk, written so that a crash never leaves a half-written file behind.

Every file is written to a temporary name in the same folder and renamed into place: a rename
within one file system is atomic, so readers (and a resumed run) see the old file or the new one,
never a torn one.  ``result.json`` is written last, so its presence means the run finished.
"""

from __future__ import annotations

import json
import os
import pickle
import platform
import random
import resource
import subprocess
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from petl.utils.paths import atomic_path, file_sha256, write_atomic  # noqa: F401 (re-exported for the run's writers)
from petl.utils.text import first_line

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
WEIGHTS_FILE = "trainable.safetensors"
MODEL_FILE = "model.json"  # what using the weights needs (petl.store.load)
CHECKPOINT_FILE = "checkpoint.pt"
RUN_FILES = (CONFIG_FILE, METRICS_FILE, RESULT_FILE, WEIGHTS_FILE, MODEL_FILE, CHECKPOINT_FILE)
# Files only a petl-run folder holds: a command writing into a folder holding one would write into a run.
RUN_MARKERS = (MODEL_FILE, WEIGHTS_FILE, RESULT_FILE, CHECKPOINT_FILE)
# resume=false moves an earlier run's files to ``<output_dir>.replaced-<time>``; reports skip such folders.
REPLACED_MARK = ".replaced-"

VERSIONED_PACKAGES = ("petl", "torch", "torchvision", "timm", "accelerate", "peft", "hydra-core", "omegaconf", "numpy")


def is_main_process() -> bool:
    """Whether this process writes the records and talks: rank 0 of a multi-process launch, or the only one.

    Read from the environment, so it works before accelerate is set up (``accelerate launch`` and
    ``torchrun`` export RANK to every process).
    """
    return os.environ.get("RANK", "0") == "0"


def enclosing_run(path: Path) -> tuple[Path, str] | None:
    """The run folder ``path`` is in or is (the nearest folder above it holding a :data:`RUN_MARKERS` file).

    Returns:
        That folder and the marker file it holds, or ``None`` when no folder above ``path`` is a run's.

    """
    target = Path(path).resolve()
    for folder in [target, *target.parents]:
        marker = next((name for name in RUN_MARKERS if (folder / name).is_file()), None)
        if marker is not None:
            return folder, marker
    return None


def temporary_files(folder: Path) -> list[Path]:
    """Temporary files of :func:`petl.utils.paths.atomic_path` left in ``folder`` by a process killed mid-write."""
    return sorted(p for name in RUN_FILES for p in folder.glob(f".{name}.*.tmp"))


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


def write_config(folder: Path, config: dict[str, Any]) -> None:
    """Write a run's resolved config as ``config.yaml`` in ``folder`` (atomically)."""
    from omegaconf import OmegaConf

    write_text(folder / CONFIG_FILE, OmegaConf.to_yaml(config))


def read_config(folder: Path) -> dict[str, Any]:
    """The config a run recorded in ``folder``'s ``config.yaml``, as plain containers."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(folder / CONFIG_FILE))


def write_metrics(path: Path, history: list[dict[str, Any]]) -> None:
    """Rewrite ``metrics.jsonl`` with one line per finished epoch."""
    write_text(path, "".join(json.dumps(row) + "\n" for row in history))


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    """Append one epoch's line (after its checkpoint is safe: a resume rewrites the file from it)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The per-epoch rows of ``run_dir/metrics.jsonl`` (none when it is missing), as reports read them.

    A line cut short by a crash, or one that is not a JSON object, is skipped: the epochs before it still count.
    """
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class DamagedFileError(ValueError):
    """A run file that exists but cannot be read (cut short, hand-edited, not petl's); the message names it."""


def _first_sentence(error: BaseException) -> str:
    # torch's zip-reader errors go on with paragraphs of advice.
    return first_line(error, type(error).__name__).split(". ")[0][:200]


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON record, or ``None`` when the file does not exist.

    Raises:
        DamagedFileError: the file is not a JSON object (cut short, not UTF-8, nested absurdly deep...).

    """
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DamagedFileError(f"{path} is damaged ({_first_sentence(error)})") from None
    if not isinstance(record, dict):
        raise DamagedFileError(f"{path} is damaged (a JSON {type(record).__name__}, not an object)")
    return record


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

    def write(tmp: Path) -> None:
        # Through a Python file object: a full disk then raises OSError(ENOSPC), where torch.save
        # given a path raises an opaque C++ error ("unexpected pos", "basic_ios::clear").
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    write_atomic(path, write)


# What every checkpoint of save_checkpoint holds (runner._train writes it); a file without them is not one.
CHECKPOINT_KEYS = ("epoch", "trainable", "optimizer", "scheduler", "rng", "history", "seconds")


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """A checkpoint written by :func:`save_checkpoint`, or ``None``; never unpickles arbitrary objects.

    Raises:
        DamagedFileError: the file cannot be read safely or is not a petl checkpoint.

    """
    if not path.exists():
        return None
    try:
        with warnings.catch_warnings():
            # torch warns about a foreign file's pickle protocol before refusing it: the refusal says enough.
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message advises weights_only=False, which would run whatever the file holds: never.
        raise DamagedFileError(f"{path} is damaged (it holds objects a safe load refuses to unpickle)") from None
    except Exception as error:  # torch raises RuntimeError (zip reader), OSError, EOFError... for a cut file
        raise DamagedFileError(f"{path} is damaged ({_first_sentence(error)})") from None
    missing = [key for key in CHECKPOINT_KEYS if key not in state] if isinstance(state, dict) else ["all"]
    if missing:
        raise DamagedFileError(f"{path} is damaged (not a petl checkpoint: {', '.join(missing)} missing)")
    return state


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


def peak_memory(device_type: str) -> tuple[float, str]:
    """Peak memory in MiB of a run on ``device_type``, and what it measures.

    CUDA's max allocated on a GPU, else the process's max RSS: also for a CPU run on a machine with a GPU, where
    the CUDA allocator's peak (zero, or an earlier GPU run's in the same process) is not the run's.
    """
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20, "cuda_max_allocated"
    return peak_rss_mb(), "process_max_rss"


def reset_peak_rss() -> bool:
    """Reset the resident-set high-water mark (VmHWM, and with it ``ru_maxrss``) to the current RSS.

    Linux supports this by writing 5 to ``/proc/self/clear_refs``, so that runs sharing one process
    (a sweep, a notebook) each get their own peak.  Returns False where it is not supported, in which
    case a peak read later may belong to anything the process did before.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _status_mb(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            line = next((line for line in f if line.startswith(key + ":")), None)
    except OSError:
        return None
    return None if line is None else int(line.split()[1]) / 1024  # reported in kB


def current_rss_mb() -> float:
    """The resident set now, in MiB (the peak so far where /proc is unavailable)."""
    now = _status_mb("VmRSS")
    return peak_rss_mb() if now is None else now


def peak_rss_mb() -> float:
    """The resident-set high-water mark, in MiB."""
    # VmHWM is what clear_refs resets; ru_maxrss also keeps the peak of anything before an exec
    # (e.g. a launcher process), so it is only the fallback where /proc is missing.
    hwm = _status_mb("VmHWM")
    if hwm is not None:
        return hwm
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if platform.system() == "Darwin" else 2**10)
