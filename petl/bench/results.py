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

from petl.run.records import RESULT_FILE
from petl.run.result import ResultError, RunResult, read_result

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


def read_all(results_dir: str | Path) -> list[tuple[Path, RunResult]]:
    """Every readable ``result.json`` under ``results_dir``, read once; an unreadable one is skipped with a warning."""
    found = []
    for path in sorted(Path(results_dir).rglob(RESULT_FILE)):
        try:
            result = read_result(path)
        except ResultError as error:
            warnings.warn(f"skipping {error}", stacklevel=2)
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
        records[key] = RunRecord(result.dataset, experiment, result.seed, path, result)
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
    seconds = sum(float(result.wall_seconds or result.train_seconds or 0.0) for _, result in results)
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
        config = yaml.safe_load(config_path.read_text())
    lr = (config.get("train") or {}).get("lr") if isinstance(config, dict) else None
    recipe = [] if lr is None else [f"lr={lr}"]
    if record.result.epochs is not None:
        recipe.append(f"{record.result.epochs} ep")
    return "; ".join(part for part in (text, ", ".join(recipe)) if part)


def number(record: RunRecord, key: str) -> float:
    # Optional numbers may be missing or null in a result.json; they count as absent, not as zero.
    value = getattr(record.result, key)
    return math.nan if value is None else float(value)
