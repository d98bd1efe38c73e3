"""The results of finished runs, as the reports read them: every ``result.json`` under a results root.

Reports only read run folders, so they are safe to build while a sweep is still writing.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petl.bench.protocol import UNSTABLE_DIR
from petl.bench.sweep import task_folder
from petl.store import files
from petl.store.files import REPLACED_MARK, RESULT_FILE, set_aside_advice
from petl.store.result import ResultError, RunResult, not_utf8, read_result
from petl.train.learning import run_not_learned
from petl.utils.text import plural, shown

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
    :mod:`petl.bench.protocol`).  A folder that is a symbolic link (a run linked in from another disk) is read as the
    folder it links to, as the sweep reads it when it finds the run done; a link back to a folder above it is not
    followed again.
    """
    root = Path(results_dir)
    return sorted(_result_files_under(root, frozenset({os.path.realpath(root)})))


def _result_files_under(folder: Path, above: frozenset[str]) -> list[Path]:
    # Path.rglob does not enter a linked folder (before Python 3.13, nor after by default): a run linked into the
    # results folder counted as done for the sweep, while the board left its cell short of that seed.
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError:
        return []  # an unreadable folder holds no record that can be read (rglob passed over it too)
    found = []
    for entry in entries:
        if _moved_aside(entry.name):
            continue
        if entry.is_dir():
            real = os.path.realpath(entry.path)
            if real not in above:  # a link back up would walk the same folders for ever
                found += _result_files_under(Path(entry.path), above | {real})
        elif entry.name == RESULT_FILE and entry.is_file():
            found.append(Path(entry.path))
    return found


def set_aside_files(results_dir: str | Path) -> list[Path]:
    """The ``result.json`` of every final that ``require_learning`` set aside under ``results_dir``.

    Only those in a cell's folder, ``<task folder>/<experiment>/unstable/<point>/seed<k>/``: an ``unstable`` folder
    nearer the root is no cell's (a folder of the user's), and its task and experiment could not be named.
    """
    root = Path(results_dir)
    found = root.rglob(f"{UNSTABLE_DIR}/*/*/{RESULT_FILE}")
    return sorted(p for p in found if len(p.relative_to(root).parts) >= 6)


def _moved_aside(part: str) -> bool:
    return REPLACED_MARK in part or part == UNSTABLE_DIR


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# What a reported run's record must hold for the leaderboard beyond what the reader checks (petl.store.result:
# every field's type and range): the counts its columns and the Pareto plot read.
_COUNTS = ("trainable_params", "trainable_params_no_head", "total_params")


def record_problem(result: RunResult) -> str | None:
    """Why a reported run's record cannot be used in a leaderboard (a count missing), or ``None``."""
    missing = [key for key in _COUNTS if getattr(result, key) is None]
    return f"field {missing[0]!r} is missing" if missing else None


def folder_problem(root: Path, path: Path, result: RunResult, task_folders: set[str]) -> str | None:
    """Why a record contradicts the folder it sits in, or ``None``.

    In a results root's layout, ``<root>/<task folder>/<experiment>/seed<k>/result.json``, the task folder says
    which task the run belongs to (:func:`petl.bench.sweep.task_folder`: ``mini-digits`` for ``mini/digits``), and
    the sweep trains into it by that name.  A record of another task there (copied, moved or edited by hand) is
    refused rather than read as a task of its own, which would add a column and leave every row incomplete.  So is,
    at any depth, a record in a ``seed<k>`` folder of another seed than ``k``: it would stand in the cell as a seed
    it is not, and the run of its seed be dropped as its copy.
    ``task_folders`` are the folder names that name a task (the registry's tasks and the runs' own); a folder
    outside them (petl-run's default ``<data>/<model>/<method>/seed<k>`` read from ``<data>/``) says nothing.
    """
    parts = path.relative_to(root).parts
    seed_folder = _SEED_DIR.match(path.parent.name)
    # Nothing finished is deleted unless the user asks: the line offers to move the run where it belongs, or aside.
    if seed_folder and int(seed_folder.group(1)) != result.seed:
        return (
            f"a run of seed {result.seed} in the folder of seed {seed_folder.group(1)}: move it to "
            f"{path.parent.parent / f'seed{result.seed}'}, or aside ({set_aside_advice(path.parent)})"
        )
    if len(parts) != 4 or not seed_folder or parts[0] not in task_folders:
        return None
    expected = task_folder(result.dataset)
    if parts[0] == expected:
        return None
    return (
        f"a run of {result.dataset} in the folder of another task ({parts[0]}/): move it to "
        f"{root / expected / parts[1] / parts[2]}, or aside ({set_aside_advice(path.parent)})"
    )


def _task_folders(results: list[tuple[Path, RunResult]]) -> set[str]:
    from petl.data import list_datasets

    return {task_folder(name) for name in list_datasets()} | {task_folder(r.dataset) for _, r in results}


def read_all(results_dir: str | Path, skipped: list[Path] | None = None) -> list[tuple[Path, RunResult]]:
    """Every usable ``result.json`` under ``results_dir``, read once.

    An unreadable file (:func:`petl.store.result.read_result` checks every field), a reported run's record
    without its counts, a record in another task's or seed's folder (:func:`folder_problem`), or one under a folder
    whose name is not UTF-8 text is skipped with a warning
    naming it (and appended to ``skipped``).  Runs replaced by ``resume=false`` (``<run>.replaced-<time>/``) are
    not read.
    """
    root = Path(results_dir)
    read: list[tuple[Path, RunResult | None, str | None]] = []
    for path in result_files(root):
        # A file name of bytes that are not UTF-8 reads as text with lone surrogates (surrogateescape).
        if not_utf8(str(path.relative_to(root))) is not None:
            # The folder names the experiment: a name of other bytes than UTF-8 cannot be written into the pages.
            read.append((path, None, f"{path}: a folder name is not UTF-8 text; rename the folder"))
            continue
        try:
            result = read_result(path)
            problem = None if result is None or result.test_top1 is None else record_problem(result)
        except ResultError as error:
            result, problem = None, str(error)
        except (KeyError, TypeError, RecursionError) as error:  # RecursionError: nested too deep for json
            result, problem = None, f"{path}: not a result record ({type(error).__name__}: {error})"
        read.append((path, result, problem))
    task_folders = _task_folders([(p, r) for p, r, problem in read if r is not None and problem is None])
    found = []
    for path, result, problem in read:
        if result is not None and problem is None:
            problem = folder_problem(root, path, result, task_folders)
        if problem is not None:
            name = problem if problem.startswith(str(path)) else f"{path}: {problem}"
            # A folder name of other bytes than UTF-8 as \xNN, as the pages show it: its lone surrogates cannot be
            # encoded, so a warning holding them fails wherever it is written as UTF-8 (a log file, another process).
            warnings.warn(f"skipping {shown(name)}", stacklevel=2)
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
    Unreadable files are skipped with a warning; a duplicate (task, experiment, seed) keeps the first when it is a
    copy of the same run, and is refused when it is another run (another backbone, epoch count or data: petl-run's
    default folders ``<data>/<model>/<method>/seed<k>`` read from ``<data>/`` put two backbones' runs in one cell).

    Raises:
        ValueError: a duplicate that differs in more than its seed, naming both files and the difference.

    """
    from petl.train.output_dir import seed_difference

    results = read_all(results_dir) if isinstance(results_dir, (str, Path)) else results_dir
    records: dict[tuple[str, str, int], RunRecord] = {}
    for path, result in results:
        if result.test_top1 is None:
            continue  # a selection trial (train.eval_test=false, petl.bench.protocol): scored on val only
        run_dir = path.parent
        experiment = run_dir.parent.name if _SEED_DIR.match(run_dir.name) else result.method
        key = (result.dataset, experiment, result.seed)
        if key in records:
            first = records[key].path
            difference = seed_difference(records[key].result, result)
            if difference:
                # Keeping the first would drop the other run from the board with nothing in it saying so.
                raise ValueError(
                    f"{path} and {first} are two runs of {result.dataset} {experiment} seed {result.seed} "
                    f"({difference}); report their folders apart, or move one run aside"
                )
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
    """What the results folder cost: its reported runs, its selection trials, and their run times summed.

    ``unscored`` names the runs in a seed folder (a final's place) that recorded no test score: neither reported
    (the table leaves them out) nor selection trials (those live under ``search/``).
    """

    runs: int
    trials: int
    seconds: float
    unscored: tuple[str, ...] = ()

    def line(self) -> str:
        """The legend line."""
        counts = [plural(self.runs, "reported run"), plural(self.trials, "selection trial")]
        if self.unscored:
            counts.append(
                f"{plural(len(self.unscored), 'run')} in a seed folder without a test score (a final that diverged or "
                f"skipped its test pass; not in the table: {', '.join(self.unscored)})"
            )
        return (
            f"**Compute**: {', '.join(counts[:-1])} and {counts[-1]} (every "
            f"result.json under the folder), {self.seconds / 3600:.2f} h of run time summed over them (each run's wall "
            "time in its result.json; sweeps run side by side overlap, so the elapsed time is shorter)."
        )


def compute_spent(results: list[tuple[Path, RunResult]], root: str | Path | None = None) -> Compute:
    """Count every finished run :func:`read_all` found, selection trials included, and sum their wall times.

    A record without a test score is a selection trial, unless it sits in a seed folder (``seed<k>/``, a final's
    place): that one is counted apart, named by its folder (relative to ``root`` when given).
    """
    unscored = [
        path.parent for path, result in results if result.test_top1 is None and _SEED_DIR.match(path.parent.name)
    ]
    trials = sum(1 for _, result in results if result.test_top1 is None) - len(unscored)
    spent = [result.wall_seconds or result.train_seconds or 0.0 for _, result in results]
    seconds = sum(float(value) for value in spent if _is_number(value))  # read_all names a run with a bad number
    names = tuple(
        (folder.relative_to(root) if root is not None and folder.is_relative_to(root) else folder).as_posix()
        for folder in unscored
    )
    return Compute(len(results) - trials - len(unscored), trials, seconds, names)


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
    if not isinstance(config, dict) and (record.path.parent / files.CONFIG_FILE).is_file():
        try:
            config = files.read_config(record.path.parent)
        except files.DamagedFileError:
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
