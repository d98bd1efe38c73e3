"""What a run leaves on disk, written so that a crash never leaves a half-written file behind.

Every file is written to a temporary name in the same folder and renamed into place: a rename
within one file system is atomic, so readers (and a resumed run) see the old file or the new one,
never a torn one.  ``result.json`` is written last, so its presence means the run finished.
"""

from __future__ import annotations

import json
import os
import pickle
import reprlib
import warnings
from pathlib import Path
from typing import Any

import torch

from petl.store import lock
from petl.utils.checks import is_finite_number
from petl.utils.paths import atomic_path, file_sha256, write_atomic  # noqa: F401 (re-exported for the run's writers)
from petl.utils.text import first_line, shown

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
WEIGHTS_FILE = "trainable.safetensors"
MODEL_FILE = "model.json"  # what using the weights needs (petl.store.run_card)
CHECKPOINT_FILE = "checkpoint.pt"
RUN_FILES = (CONFIG_FILE, METRICS_FILE, RESULT_FILE, WEIGHTS_FILE, MODEL_FILE, CHECKPOINT_FILE)
# Files only a petl-run folder holds: a command writing into a folder holding one would write into a run.
RUN_MARKERS = (MODEL_FILE, WEIGHTS_FILE, RESULT_FILE, CHECKPOINT_FILE)
# A timm model folder (timm's local-dir and hub layout), what petl-export out=FOLDER writes (petl.deploy.export).
TIMM_FOLDER_FILES = ("config.json", "model.safetensors")  # its config, its weights
# The format petl-export records in what it writes (a .safetensors file's metadata, a folder's config.json), by which
# a file given where a run folder is wanted is told to be an export (file_not_run).
EXPORT_FORMAT = "petl-export-1"
# petl-bench's selection trials: <cell>/search/<point>/, whose weights it removes once scored (the finals retrain).
SEARCH_DIR = "search"
# resume=false moves an earlier run's files to ``<output_dir>.replaced-<time>``; reports skip such folders.
REPLACED_MARK = ".replaced-"


def set_aside_advice(folder: Path) -> str:
    """How to set a finished run's folder aside by hand (``rename FOLDER to NAME.replaced-old``).

    Nothing finished is deleted unless the user asks: a line naming a run in the way offers this, the name
    :data:`REPLACED_MARK` gives (as ``resume=false`` sets a run aside), which the reports and sweeps skip.
    """
    return f"rename {folder} to {folder.name}{REPLACED_MARK}old"


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


def check_outside_runs(path: Path, said: str, product: str) -> None:
    """Refuse to write ``path`` inside a run folder (:func:`enclosing_run`), even with ``overwrite=true``.

    A run's files are written by the run alone: a prediction, an export or a report there could replace one.

    Args:
        path: where the command would write.
        said: how the refusal names it (``out=preds.csv``).
        product: what the command writes (``a prediction``), for the refusal's reason.

    Raises:
        ValueError: one line naming ``said``, the run folder and the run file it holds.

    """
    inside = enclosing_run(path)
    if inside is not None:
        folder, marker = inside
        raise ValueError(
            f"{said} is inside the run folder {shown(folder)} (it holds {marker}): write it elsewhere (a run's files "
            f"are never replaced by {product})"
        )


def stopped_before_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds what a petl-run stopped before its first checkpoint left, and nothing else of a run.

    A run writes its ``config.yaml`` as it starts (then caches features, then writes ``metrics.jsonl``); its
    checkpoint comes at its first epoch's end, its weights, ``model.json`` and ``result.json`` at its last.  So a run's
    config (checked: :func:`read_config`), with or without ``metrics.jsonl``, and none of :data:`RUN_MARKERS` is a
    run stopped (Ctrl-C, a kill) before its first checkpoint: petl-run rewrites it, and petl-predict, petl-export,
    petl-serve and :func:`petl.load_run` name it so (:func:`unfinished_run`).  Weights or a ``model.json`` there are
    a finished run's (its ``result.json`` deleted), and a ``config.yaml`` that is not a run's is someone else's.
    """
    if not (folder / CONFIG_FILE).is_file() or any((folder / name).exists() for name in RUN_MARKERS):
        return False
    try:
        read_config(folder)
    except DamagedFileError:
        return False
    return True


def unfinished_run(folder: Path) -> str | None:
    """The one line for a folder petl-run has not finished (``checkpoint.pt`` without ``result.json``, or a run stopped
    before its first checkpoint: :func:`stopped_before_checkpoint`), or ``None``.

    Every command given such a folder as a run (petl-predict, petl-export, petl-serve, :func:`petl.load_run`) says
    this line, rather than what it lacks of a finished run.  A run a live process is training now (its lock held)
    is said to be one, even before its first checkpoint: running its command again would be refused.
    """
    if (folder / RESULT_FILE).is_file():
        return None
    started = (folder / CHECKPOINT_FILE).is_file() or (folder / CONFIG_FILE).is_file()
    if started and lock.held_by_live_process(folder):
        return f"{shown(folder)} is a run being trained now ({lock.describe_holder(folder)}): wait for it to finish"
    if (folder / CHECKPOINT_FILE).is_file():
        return (
            f"{shown(folder)} is an unfinished petl-run folder ({CHECKPOINT_FILE} without {RESULT_FILE}): run the "
            "same petl-run command again (resume=true, the default) to resume it"
        )
    if stopped_before_checkpoint(folder):
        return (
            f"{shown(folder)} is a petl-run folder stopped before its first epoch ended ({CONFIG_FILE} without "
            f"{CHECKPOINT_FILE} or {RESULT_FILE}): run the same petl-run command again to train it"
        )
    return None


def exported_not_run(folder: Path) -> str | None:
    """The one line for a timm model folder given where a run folder is wanted, or ``None``: without it, the answer
    was only that the folder lacks a run's files.

    A folder petl-export wrote (its ``config.json`` carries petl's export marker, :func:`petl_export_config`) points
    back to its run; any other (a timm model downloaded from the hub, say) is named as a timm folder, no more.
    """
    if (folder / MODEL_FILE).exists() or not all((folder / name).is_file() for name in TIMM_FOLDER_FILES):
        return None
    load = f"load it with timm (timm.create_model('local-dir:{shown(folder)}', pretrained=True))"
    if not petl_export_config(folder / TIMM_FOLDER_FILES[0]):
        return (
            f"{shown(folder)} is a timm model folder ({', '.join(TIMM_FOLDER_FILES)}) that petl-export did not write "
            f"(its config.json has no petl section: a model downloaded from the hub, say), not a petl-run folder: "
            f"give a petl-run output folder (model.json beside {WEIGHTS_FILE}), or {load}"
        )
    return (
        f"{shown(folder)} is a plain timm model ({', '.join(TIMM_FOLDER_FILES)}, as petl-export writes it), not a "
        f"petl-run folder: give the run folder it was exported from, or {load}"
    )


def petl_export_config(path: Path) -> bool:
    """Whether ``path`` is a timm ``config.json`` petl-export wrote: its ``petl`` section names an export format
    (``petl-export-N``).  A file that cannot be read as a JSON object is not.
    """
    try:
        config = read_json(path)
    except DamagedFileError:
        return False
    section = (config or {}).get("petl")
    return isinstance(section, dict) and str(section.get("format", "")).startswith("petl-export")


def file_not_run(path: Path, given: str) -> str:
    """The one line for a file given where a run folder is wanted (``given``: the argument as written).

    A file of a run (its ``model.json``, its weights) points to its folder, and a file petl-export wrote says how timm
    loads it (:func:`exported_file_not_run`); any other file (an image given before the run, say) does not, and
    naming its folder as the run would only lead to a second refusal.
    """
    if (path.parent / MODEL_FILE).is_file() or (path.parent / WEIGHTS_FILE).is_file():
        return f"{given}: a file, not a run folder: give the folder holding it ({path.parent})"
    exported = exported_file_not_run(path, given)
    if exported is not None:
        return exported
    return f"{given}: a file, not a run folder: give a petl-run output folder (model.json beside {WEIGHTS_FILE})"


def exported_file_not_run(path: Path, given: str) -> str | None:
    """The one line for a file petl-export wrote given where a run folder is wanted, or ``None`` for any other file.

    Args:
        path: the file.
        given: the argument as written (``task.x=FILE`` for petl-serve), which the line names; the timm call it gives
            loads ``path``.

    """
    exported = exported_not_run(path.parent) if path.name in TIMM_FOLDER_FILES else None
    if exported is not None:  # exported/model.safetensors: the folder is what timm loads
        return f"{given}: a file, not a run folder; {exported}"
    meta = _export_metadata(path)
    if meta is None:
        return None
    # petl-export out=FILE.safetensors: its metadata says how timm builds it.
    kwargs = "".join(f", {key}={value!r}" for key, value in meta["kwargs"].items())
    return (
        f"{given} is a plain timm model's weights ({meta['timm_model']}, as petl-export writes it), not a "
        f"petl-run folder: give the run folder it was exported from, or load it with timm "
        f"(timm.create_model({meta['timm_model']!r}, num_classes={meta['num_classes']}{kwargs}, "
        f"checkpoint_path={shown(path)!r}))"
    )


def _export_metadata(path: Path) -> dict[str, Any] | None:
    """What a ``.safetensors`` file petl-export wrote records of its timm model, or ``None`` (another file, or one
    whose metadata cannot be read: it is named as a file, no more).
    """
    if path.suffix.lower() != ".safetensors":
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as weights:
            meta = weights.metadata() or {}
        if meta.get("format") != EXPORT_FORMAT:
            return None
        kwargs = json.loads(meta["timm_kwargs"])
        return {"timm_model": meta["timm_model"], "num_classes": int(meta["num_classes"]), "kwargs": dict(kwargs)}
    except Exception:  # a damaged or hand-made file: safetensors', json's, KeyError, ValueError, TypeError
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


# What every config petl-run records holds: a file without them (cut short, hand-made, another record) is none.
_CONFIG_NODES = ("method", "data", "model", "train")


def read_config(folder: Path) -> dict[str, Any]:
    """The config a run recorded in ``folder``'s ``config.yaml``, as plain containers (the one reader of the file).

    Raises:
        DamagedFileError: the file cannot be read (not UTF-8, not YAML, a folder) or is not a run's config (not a
            mapping, or without its ``method``, ``data``, ``model`` and ``train`` nodes); the message names it.

    """
    from omegaconf import OmegaConf

    path = folder / CONFIG_FILE
    try:
        # OmegaConf's loader, not yaml.safe_load: it reads 1e-3 as the float the writer meant, not as text.
        config = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as error:  # OSError, UnicodeDecodeError, yaml's errors (not ValueErrors), OmegaConf's
        raise DamagedFileError(f"{path} is damaged ({_first_sentence(error)})") from None
    if not isinstance(config, dict):
        raise DamagedFileError(f"{path} is damaged (a YAML {type(config).__name__}, not a run's config)")
    missing = [name for name in _CONFIG_NODES if not isinstance(config.get(name), dict)]
    if missing:
        raise DamagedFileError(f"{path} is damaged (not a run's config: no {', '.join(missing)} node)")
    return config


def write_metrics(path: Path, history: list[dict[str, Any]]) -> None:
    """Rewrite ``metrics.jsonl`` with one line per finished epoch."""
    write_text(path, "".join(json.dumps(row) + "\n" for row in history))


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    """Append one epoch's line (after its checkpoint is safe: a resume rewrites the file from it)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The per-epoch rows of ``run_dir/metrics.jsonl`` (none when it is missing), as reports read them.

    A line cut short by a crash, or one that is not a JSON object (bytes that are not UTF-8 included), is skipped:
    the epochs before it still count.
    """
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    # errors="replace": a byte that is not UTF-8 spoils its line (skipped below), not every report of the folder.
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
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
        DamagedFileError: the file is not a JSON object (cut short, not UTF-8, nested absurdly deep, a folder...).

    """
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
        raise DamagedFileError(f"{path} is damaged ({_first_sentence(error)})") from None
    if not isinstance(record, dict):
        raise DamagedFileError(f"{path} is damaged (a JSON {type(record).__name__}, not an object)")
    return record


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write a checkpoint atomically (trainable weights, optimizer, scheduler, RNG, history)."""

    def write(tmp: Path) -> None:
        # Through a Python file object: a full disk then raises OSError(ENOSPC), where torch.save
        # given a path raises an opaque C++ error ("unexpected pos", "basic_ios::clear").
        with open(tmp, "wb") as f:
            torch.save({"version": CHECKPOINT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())

    write_atomic(path, write)


# What every checkpoint of save_checkpoint holds (runner._train writes it); a file without them is not one.
CHECKPOINT_KEYS = ("epoch", "trainable", "optimizer", "scheduler", "rng", "history", "seconds")
# The checkpoint's layout, written by save_checkpoint; a file without it is one petl wrote before (the same layout).
CHECKPOINT_VERSION = 1


class NewerFileError(DamagedFileError):
    """A run file written by a newer petl than this one; the message names it and its version."""


def newer_file(path: Path, found: str, newest: str) -> NewerFileError:
    """The error for a file of a newer petl: ``PATH was written by a newer petl (FOUND; this petl reads up to NEWEST)``.

    The one wording of every versioned file petl writes (:func:`check_version`, the weights' and ``model.json``'s
    ``format``); the caller adds what to do (upgrade petl, or move the file aside).
    """
    return NewerFileError(f"{path} was written by a newer petl ({found}; this petl reads up to {newest})")


def check_version(path: Path, version: Any, newest: int, record: str) -> None:
    """Refuse a ``version`` field this petl cannot read: the one check of the files that record a version number.

    Args:
        path: the file, first word of each message.
        version: the value its ``version`` field holds (a file of before the field existed: 1, by the caller).
        newest: the newest version this petl writes and reads.
        record: what the file is, before the word ``version`` (``checkpoint``, ``estimate``).

    Raises:
        DamagedFileError: not a positive integer (``PATH is damaged (RECORD version 'x' is not a positive
            integer)``).
        NewerFileError: above ``newest`` (:func:`newer_file`).

    """
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise DamagedFileError(
            f"{path} is damaged ({record} version {reprlib.repr(version)} is not a positive integer)"
        )
    if version > newest:
        raise newer_file(path, f"{record} version {version}", str(newest))


def _checkpoint_problem(state: dict[str, Any]) -> str | None:
    """What in a loaded checkpoint is not as :func:`save_checkpoint` writes it, or ``None``.

    A hand-edited or foreign value would otherwise fail deep in the resume (a bare ``TypeError``), or be used:
    an ``epoch`` beyond its ``history`` resumed a run past epochs it never trained.
    """

    def number(value: Any) -> bool:
        return is_finite_number(value) and value >= 0

    epoch, history = state["epoch"], state["history"]
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 1:
        return f"epoch {epoch!r} is not a positive integer"
    if not isinstance(history, list) or not all(isinstance(row, dict) for row in history):
        return "history is not a list of epoch records"
    if len(history) != epoch:
        return f"history holds {len(history)} epochs for epoch {epoch}"
    for key in ("seconds", "wall_seconds"):
        if key in state and not number(state[key]):
            return f"{key} {state[key]!r} is not a non-negative number"
    trainable = state["trainable"]
    if not isinstance(trainable, dict) or not all(isinstance(t, torch.Tensor) for t in trainable.values()):
        return "trainable is not a mapping of tensors"
    optimizer = state["optimizer"]
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict):
        return "optimizer is not an optimizer's state"
    if not isinstance(optimizer.get("param_groups"), list):
        return "optimizer is not an optimizer's state"
    for key in ("scheduler", "rng"):
        if not isinstance(state[key], dict):
            return f"{key} is not a mapping"
    scheduler = _scheduler_problem(state["scheduler"], len(optimizer["param_groups"]))
    if scheduler is not None:
        return scheduler
    processes = state.get("num_processes", 1)  # absent from older checkpoints and petl-pretrain's
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        return f"num_processes {reprlib.repr(processes)} is not a positive integer"
    for key in ("scaler", "inputs", "method_config"):  # absent from older checkpoints and petl-pretrain's
        if state.get(key) is not None and not isinstance(state[key], dict):
            return f"{key} is not a mapping"
    return None


def _scheduler_problem(scheduler: dict[str, Any], groups: int) -> str | None:
    """What in a checkpoint's ``scheduler`` is not the state of petl's schedule over ``groups`` parameter groups.

    ``LambdaLR.load_state_dict`` takes any mapping into the scheduler's attributes: a step count as text failed at
    the first step after the resume began, a negative or NaN one (or a NaN lr) trained on at a wrong or NaN rate,
    and another schedule's state (a StepLR's) failed on its missing ``lr_lambdas`` as a bare key.
    """
    lambdas = scheduler.get("lr_lambdas")
    # build_optimizer's warm-up and cosine factor is a plain function: LambdaLR saves None for each group's.
    if not isinstance(lambdas, list) or any(factor is not None for factor in lambdas):
        return "scheduler is not the state of petl's warm-up and cosine schedule"
    # _step_count and _last_lr: LambdaLR's own bookkeeping, optional (not every torch version writes both).
    steps = {"last_epoch": scheduler.get("last_epoch"), "_step_count": scheduler.get("_step_count", 0)}
    for key, step in steps.items():
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            return f"scheduler {key} {reprlib.repr(step)} is not a non-negative integer"
    base = scheduler.get("base_lrs")
    rates = {"base_lrs": base, "_last_lr": scheduler.get("_last_lr", base)}
    for key, lrs in rates.items():
        if not isinstance(lrs, list) or not all(is_finite_number(lr) and lr >= 0 for lr in lrs):
            return f"scheduler {key} {reprlib.repr(lrs)} is not a list of non-negative learning rates"
    other = next((size for size in (len(lambdas), *map(len, rates.values())) if size != groups), None)
    if other is not None:
        return f"scheduler is for {other} parameter groups, the optimizer has {groups}"
    return None


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """A checkpoint written by :func:`save_checkpoint`, or ``None``; never unpickles arbitrary objects.

    Raises:
        DamagedFileError: the file cannot be read safely, is not a petl checkpoint or holds a value of another type
            or range than :func:`save_checkpoint` writes (:class:`NewerFileError`: a newer petl wrote it).

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
    # A checkpoint without a version was written before it was, in this layout: version 1.
    check_version(path, state.get("version", 1), CHECKPOINT_VERSION, "checkpoint")
    problem = _checkpoint_problem(state)
    if problem is not None:
        raise DamagedFileError(f"{path} is damaged ({problem})")
    return state
