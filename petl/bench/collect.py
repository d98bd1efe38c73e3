"""The results of finished runs, as the reports read them: every ``result.json`` under a results root.

Reports only read run folders, so they are safe to build while a sweep is still writing.
"""

from __future__ import annotations

import math
import re
import statistics
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from petl.bench.protocol import UNSTABLE_DIR
from petl.store.files import REPLACED_MARK, RESULT_FILE
from petl.store.result import ResultError, RunResult, read_result
from petl.train.learning import run_not_learned

_SEED_DIR = re.compile(r"^seed(\d+)$")

# A list option whose text is longer than this many characters is shown by its length in the config column.
LONG_OPTION = 60


@dataclass(frozen=True)
class RunRecord:
    """One finished run: its cell in the sweep and its ``result.json``."""

    task: str
    experiment: str
    seed: int
    path: Path
    result: RunResult
    not_learned: str | None = None  # why its training did not learn (petl.train.learning), if it did not


def result_files(results_dir: str | Path) -> list[Path]:
    """Every ``result.json`` under ``results_dir``, less those of runs moved aside.

    Moved aside: runs replaced by ``resume=false`` (``<run>.replaced-<time>/``), and the finals a suite's
    ``require_learning`` set aside at a point where training did not learn (``unstable/<point>/seed<k>/``,
    :mod:`petl.bench.protocol`).
    """
    root = Path(results_dir)
    paths = sorted(root.rglob(RESULT_FILE))
    return [p for p in paths if not any(_moved_aside(part) for part in p.relative_to(root).parts)]


def set_aside_files(results_dir: str | Path) -> list[Path]:
    """The ``result.json`` of every final that ``require_learning`` set aside under ``results_dir``."""
    return sorted(p for p in Path(results_dir).rglob(f"{UNSTABLE_DIR}/*/*/{RESULT_FILE}"))


def _moved_aside(part: str) -> bool:
    return REPLACED_MARK in part or part == UNSTABLE_DIR


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# What a reported run's result.json must hold for the leaderboard: its counts, and numbers (or nothing) where the
# columns read numbers.  A file read from disk is untrusted: one with a bad field is skipped, never half-used.
_COUNTS = ("trainable_params", "trainable_params_no_head", "total_params")
_OPTIONAL_NUMBERS = ("val_top1", "epochs", "train_seconds", "images_per_second", "peak_memory_mb", "wall_seconds")
_OPTIONAL_MAPPINGS = ("method_config", "config", "selection")


def record_problem(result: Mapping[str, Any]) -> str | None:
    """Why a reported run's record cannot be used in a leaderboard (a field missing or malformed), or ``None``."""

    def bad(key: str, what: str) -> str:
        if result.get(key) is None:
            return f"field {key!r} is missing"
        return f"field {key!r} is {result[key]!r}, not {what}"

    if result.get("test_top1") is not None and not _is_number(result["test_top1"]):
        return bad("test_top1", "a number")
    for key in _COUNTS:
        if not _is_number(result.get(key)) or result[key] < (1 if key == "total_params" else 0):
            return bad(key, "a positive count" if key == "total_params" else "a count")
    for key in _OPTIONAL_NUMBERS:
        if result.get(key) is not None and not _is_number(result[key]):
            return bad(key, "a number")
    for key in _OPTIONAL_MAPPINGS:
        if result.get(key) is not None and not isinstance(result[key], Mapping):
            return bad(key, "a mapping")
    trials = (result.get("selection") or {}).get("trials") or []
    if not isinstance(trials, list) or not all(isinstance(t, Mapping) for t in trials):
        return "field 'selection' has trials that are not mappings"
    return None


def read_all(results_dir: str | Path, skipped: list[Path] | None = None) -> list[tuple[Path, RunResult]]:
    """Every usable ``result.json`` under ``results_dir``, read once.

    An unreadable file, or a reported run's record with a field missing or malformed, is skipped with a warning
    naming it (and appended to ``skipped``).  Runs replaced by ``resume=false`` (``<run>.replaced-<time>/``)
    are not read.
    """
    found = []
    for path in result_files(results_dir):
        try:
            result = read_result(path)
            problem = None if result is None or result.test_top1 is None else record_problem(result.to_json())
        except ResultError as error:
            result, problem = None, str(error)
        except (KeyError, TypeError, RecursionError) as error:  # a record without dataset or seed...
            result, problem = None, f"{path}: not a result record ({type(error).__name__}: {error})"
        if problem is not None:
            name = problem if problem.startswith(str(path)) else f"{path}: {problem}"
            warnings.warn(f"skipping {name}", stacklevel=2)
            if skipped is not None:
                skipped.append(path)
            continue
        if result is not None:
            found.append((path, result))
    return found


def collect(results_dir: str | Path | list[tuple[Path, RunResult]]) -> list[RunRecord]:
    """The reported runs under ``results_dir`` (or among results :func:`read_all` read).

    The experiment is the folder above ``seed<k>/`` (so ``adapter_parallel`` and ``adapter_sequential``
    stay apart although both ran method ``adapter``); outside that layout the method name stands in.
    Unreadable files are skipped with a warning; a duplicate (task, experiment, seed) keeps the first.
    """
    results = read_all(results_dir) if isinstance(results_dir, (str, Path)) else results_dir
    records: dict[tuple[str, str, int], RunRecord] = {}
    for path, result in results:
        if result.test_top1 is None:
            continue  # a selection trial (train.eval_test=false, petl.bench.protocol): scored on val only
        run_dir = path.parent
        experiment = run_dir.parent.name if _SEED_DIR.match(run_dir.name) else result.method
        key = (result.dataset, experiment, result.seed)
        if key in records:
            warnings.warn(f"skipping {path}: {key} already read from {records[key].path}", stacklevel=2)
            continue
        verdict = run_not_learned(run_dir, result)
        records[key] = RunRecord(result.dataset, experiment, result.seed, path, result, verdict)
    return list(records.values())


def task_group(task: str) -> str:
    """The benchmark group of a dataset (natural / specialized / structured / fgvc, else ``other``).

    The dataset registry says; a task it does not know (registered by a plugin in the process that trained,
    not in this one) is ``fgvc`` by its prefix, else ``other``: a report never fails on a task name.
    """
    from petl.data import get_info

    try:
        return str(get_info(task).group)
    except (KeyError, ValueError):
        return "fgvc" if task.startswith("fgvc/") else "other"


@dataclass(frozen=True)
class Compute:
    """What the results folder cost: its reported runs, its selection trials, and their run times summed."""

    runs: int
    trials: int
    seconds: float

    def line(self) -> str:
        """The legend line."""
        return (
            f"**Compute**: {self.runs} reported runs and {self.trials} selection trials (every result.json under "
            f"the folder), {self.seconds / 3600:.2f} h of run time summed over them (each run's wall time in its "
            "result.json; sweeps run side by side overlap, so the elapsed time is shorter)."
        )


def compute_spent(results: list[tuple[Path, RunResult]]) -> Compute:
    """Count every finished run :func:`read_all` found, selection trials included, and sum their wall times."""
    trials = sum(1 for _, result in results if result.test_top1 is None)
    spent = [result.wall_seconds or result.train_seconds or 0.0 for _, result in results]
    seconds = sum(float(value) for value in spent if _is_number(value))  # read_all names a run with a bad number
    return Compute(len(results) - trials, trials, seconds)


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def nanmean(values: list[float]) -> float:
    return mean([v for v in values if not math.isnan(v)])


def nanmax(values: list[float]) -> float:
    return max((v for v in values if not math.isnan(v)), default=math.nan)


def format_option(value: Any) -> str:
    if isinstance(value, list | tuple):
        text = "[" + ",".join(format_option(v) for v in value) + "]"
        # A calibrated choice (SCT's channel indices, different on every task) would fill the row; its size says
        # enough there, and result.json keeps the values.
        return text if len(text) <= LONG_OPTION else f"[{len(value)} values]"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={format_option(v)}" for k, v in sorted(value.items()))
    return str(value)


def describe_run(record: RunRecord) -> str:
    """Method options (minus the per-task class count) and the learning rate / epochs of one run."""
    options = {k: v for k, v in (record.result.method_config or {}).items() if k != "num_classes"}
    text = format_option(options)
    # The resolved config sits in result.json (else config.yaml beside it); the learning rate is the one
    # recipe value experiments change (full fine-tuning), so it belongs beside the method options.
    config = record.result.config
    config_path = record.path.parent / "config.yaml"
    if not isinstance(config, dict) and config_path.is_file():
        try:
            config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError, yaml.YAMLError):
            config = None  # only the lr is read from it: the row shows without one
    train = config.get("train") if isinstance(config, dict) else None
    lr = train.get("lr") if isinstance(train, dict) else None
    recipe = [] if lr is None else [f"lr={lr}"]
    if record.result.epochs is not None:
        recipe.append(f"{record.result.epochs} ep")
    return "; ".join(part for part in (text, ", ".join(recipe)) if part)


def number(record: RunRecord, key: str) -> float:
    # Optional numbers may be missing or null in a result.json; they count as absent, not as zero.
    value = getattr(record.result, key)
    return math.nan if value is None else float(value)
