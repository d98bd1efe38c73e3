"""Leaderboards built from results folders alone.

``collect`` reads every ``result.json`` under a results root (written by ``petl-bench`` or by
``petl-run --multirun`` into the same ``<task>/<experiment>/seed<k>/`` layout); ``aggregate`` turns
them into one row per experiment; ``write_report`` writes ``leaderboard.md``, ``leaderboard.csv``,
``leaderboard.html`` and ``pareto.png``.  Reports only read run folders, so they are safe to build
while a sweep is still writing.

Every leaderboard column is one :class:`Column` declaration in :func:`leaderboard_columns`: its
label, how its value is computed from an experiment's runs, how it is shown and how it is written to
the CSV.  The CSV, Markdown and HTML writers only iterate the declarations.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import statistics
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from petl.bench.published import TABLES, PublishedRow, PublishedTable, ppt, table_for
from petl.bench.table import Cell, Header, Table
from petl.presets import FAMILIES
from petl.run.records import METRICS_FILE, RESULT_FILE, write_atomic, write_text

# Groups in the order benchmarks print them; unknown groups follow alphabetically.
GROUP_ORDER = ("natural", "specialized", "structured", "fgvc")
_SEED_DIR = re.compile(r"^seed(\d+)$")
# Convergence is judged on the last 20 % of epochs (issue 12): the val top-1 change over that stretch.
CONVERGENCE_TAIL = 0.2


@dataclass(frozen=True)
class RunRecord:
    """One finished run: its cell in the sweep and the contents of its ``result.json``."""

    task: str
    experiment: str
    seed: int
    path: Path
    result: dict[str, Any]


def collect(results_dir: str | Path) -> list[RunRecord]:
    """Read every ``result.json`` under ``results_dir``.

    The experiment is the folder above ``seed<k>/`` (so ``adapter_parallel`` and ``adapter_sequential``
    stay apart although both ran method ``adapter``); outside that layout the method name stands in.
    Unreadable files are skipped with a warning; a duplicate (task, experiment, seed) keeps the first.
    """
    records: dict[tuple[str, str, int], RunRecord] = {}
    for path in sorted(Path(results_dir).rglob(RESULT_FILE)):
        try:
            result = json.loads(path.read_text())
            task, seed = str(result["dataset"]), int(result["seed"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            warnings.warn(f"skipping {path}: {err}", stacklevel=2)
            continue
        if result.get("test_top1") is None:
            continue  # a selection trial (train.eval_test=false, petl.bench.protocol): scored on val only
        run_dir = path.parent
        experiment = run_dir.parent.name if _SEED_DIR.match(run_dir.name) else str(result.get("method", "?"))
        key = (task, experiment, seed)
        if key in records:
            warnings.warn(f"skipping {path}: {key} already read from {records[key].path}", stacklevel=2)
            continue
        records[key] = RunRecord(task, experiment, seed, path, result)
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
class TaskScore:
    """Top-1 (%) of one experiment on one task over its seeds; ``std`` is NaN below two seeds."""

    mean: float
    std: float
    seeds: tuple[int, ...]


# What a published column shows for a row: the published row, or why there is none to show.
NO_PUBLISHED_ROW = "no published row"
DIFFERENT_BACKBONE = "different backbone"


@dataclass
class ExperimentRow:
    """One leaderboard row: an experiment's runs, the figures several columns share, and each column's value.

    Attributes:
        experiment: the experiment name (its results folder).
        runs: every run of the experiment.
        scores: per task, the mean and std over seeds.
        task_mean: unweighted mean of the per-task means (the sort key).
        group_means: per benchmark group, the mean of its tasks' means.
        trainable: trainable parameters, head included (mean over runs).
        trainable_no_head: trainable parameters outside the head (mean over runs).
        published: per published table key, the matching published row, or the reason none is shown
            (:data:`NO_PUBLISHED_ROW`, :data:`DIFFERENT_BACKBONE`).
        values: each column's computed value, by column key.

    """

    experiment: str
    runs: list[RunRecord]
    scores: dict[str, TaskScore]
    task_mean: float
    group_means: dict[str, float]
    trainable: float
    trainable_no_head: float
    published: dict[str, PublishedRow | str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def group_mean(self) -> float:
        """Mean of the group means (what VPT, NOAH and Adapter+ report)."""
        return _mean(list(self.group_means.values()))


def _as_csv(key: str, digits: int | None = 4) -> Callable[[Any], dict[str, Any]]:
    # The default CSV writer of a column: one field named after the column, floats rounded (None: as
    # they are), NaN (nothing to show) written empty.
    def fields(value: Any) -> dict[str, Any]:
        if isinstance(value, float):
            value = "" if math.isnan(value) else (value if digits is None else round(value, digits))
        return {key: value}

    return fields


@dataclass(frozen=True)
class Column:
    """One leaderboard column, declared once.

    Attributes:
        key: stable key (the HTML's sort links; the CSV field unless ``csv`` says otherwise).
        label: the displayed header; ``None`` for a CSV-only column.
        compute: the column's value from a row (its runs and the figures rows share).
        show: the displayed (text, sort key) cell of a value.
        csv: the CSV fields of a value (default: ``{key: value}``, floats rounded to 4 digits).
        kind: ``measured``, ``published`` or ``info`` (styling; info columns are left-aligned).
        note: a legend line for the column, printed under the tables.
        detail: shown in the details table rather than the main one, which keeps to what answers "which
            experiment wins at what budget" (parameters, means, per-task accuracy) so that it fits a screen.

    """

    key: str
    label: str | None
    compute: Callable[[ExperimentRow], Any]
    show: Callable[[Any], Cell] = field(default=lambda value: _num(value))
    csv: Callable[[Any], dict[str, Any]] | None = None
    kind: str = "measured"
    note: str = ""
    detail: bool = False

    def csv_fields(self, value: Any) -> dict[str, Any]:
        """The CSV fields of ``value``."""
        return (self.csv or _as_csv(self.key))(value)


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


def compute_spent(results_dir: str | Path) -> Compute:
    """Count every finished run under ``results_dir``, selection trials included, and sum their wall times."""
    runs = trials = 0
    seconds = 0.0
    for path in sorted(Path(results_dir).rglob(RESULT_FILE)):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # collect() warns about the same file
        if not isinstance(result, Mapping):
            continue
        if result.get("test_top1") is None:
            trials += 1
        else:
            runs += 1
        seconds += float(result.get("wall_seconds") or result.get("train_seconds") or 0.0)
    return Compute(runs, trials, seconds)


@dataclass
class Leaderboard:
    """Everything a report renders: the tasks and groups found, one row per experiment, and the columns.

    ``families`` maps an experiment to its method family (experiments without one are left out; they
    count as a family of their own, named after their method: :meth:`family`).
    """

    results_dir: Path
    tasks: list[str]
    groups: dict[str, str]
    rows: list[ExperimentRow]
    models: list[str]
    tables: list[PublishedTable]
    memory_kinds: list[str] = field(default_factory=list)
    families: dict[str, str] = field(default_factory=dict)
    columns: list[Column] = field(default_factory=list)
    compute: Compute | None = None

    @property
    def family_order(self) -> list[str]:
        """Families present, in :data:`petl.presets.FAMILIES` order, then any other alphabetically."""
        known = list(FAMILIES)
        present = {self.family(row) for row in self.rows}
        return sorted(present, key=lambda f: (known.index(f) if f in known else len(known), f))

    def family(self, row: ExperimentRow) -> str:
        """The family of ``row``'s experiment; without one, the method its runs ran (a family of its own)."""
        return self.families.get(row.experiment) or ", ".join(
            dict.fromkeys(str(r.result.get("method")) for r in row.runs)
        )

    @property
    def group_names(self) -> list[str]:
        """Groups present, in benchmark order."""
        return _order_groups(set(self.groups.values()))

    def complete(self, row: ExperimentRow) -> bool:
        """Whether ``row`` has a score on every task, each over as many seeds as the fullest cell of the board."""
        seeds = max((len(s.seeds) for r in self.rows for s in r.scores.values()), default=0)
        return len(row.scores) == len(self.tasks) and all(len(s.seeds) == seeds for s in row.scores.values())


def _order_groups(groups: set[str]) -> list[str]:
    return sorted(groups, key=lambda g: (GROUP_ORDER.index(g) if g in GROUP_ORDER else len(GROUP_ORDER), g))


def _task_order_key(task: str, groups: dict[str, str]) -> tuple:
    # Benchmarks print tasks group by group and, within a group, in their published column order.
    order = _order_groups(set(groups.values()))
    table = table_for(task)
    columns = list(next(iter(table.rows().values())).top1) if table else []
    column = table.column(task) if table else ""
    position = columns.index(column) if column in columns else len(columns)
    return order.index(groups[task]), position, task


# A list option whose text is longer than this many characters is shown by its length in the config column.
LONG_OPTION = 60


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _nanmean(values: list[float]) -> float:
    return _mean([v for v in values if not math.isnan(v)])


def _nanmax(values: list[float]) -> float:
    return max((v for v in values if not math.isnan(v)), default=math.nan)


def _format_option(value: Any) -> str:
    if isinstance(value, list | tuple):
        text = "[" + ",".join(_format_option(v) for v in value) + "]"
        # A calibrated choice (SCT's channel indices, different on every task) would fill the row; its size says
        # enough there, and result.json keeps the values.
        return text if len(text) <= LONG_OPTION else f"[{len(value)} values]"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_format_option(v)}" for k, v in sorted(value.items()))
    return str(value)


def _describe_run(record: RunRecord) -> str:
    """Method options (minus the per-task class count) and the learning rate / epochs of one run."""
    options = {k: v for k, v in (record.result.get("method_config") or {}).items() if k != "num_classes"}
    text = _format_option(options)
    # The resolved config sits in result.json (else config.yaml beside it); the learning rate is the one
    # recipe value experiments change (full fine-tuning), so it belongs beside the method options.
    config = record.result.get("config")
    config_path = record.path.parent / "config.yaml"
    if not isinstance(config, dict) and config_path.is_file():
        config = yaml.safe_load(config_path.read_text())
    lr = (config.get("train") or {}).get("lr") if isinstance(config, dict) else None
    recipe = [] if lr is None else [f"lr={lr}"]
    if record.result.get("epochs") is not None:
        recipe.append(f"{record.result['epochs']} ep")
    return "; ".join(part for part in (text, ", ".join(recipe)) if part)


def _field(record: RunRecord, key: str) -> float:
    # Optional numbers may be missing or null in a result.json; they count as absent, not as zero.
    value = record.result.get(key)
    return math.nan if value is None else float(value)


def _published_status(runs: list[RunRecord], table: PublishedTable, row_name: str | None) -> PublishedRow | str:
    """The published row to show beside ``runs`` in ``table``, or why none is shown."""
    row = table.rows().get(row_name) if row_name else None
    if row is None:
        return NO_PUBLISHED_ROW
    # Published figures sit beside petl's only when petl measured on the same pretrained backbone.
    covered = [r for r in runs if table.covers(r.task)] or runs
    if any(r.result.get("model") != table.backbone or r.result.get("pretrained") is False for r in covered):
        return DIFFERENT_BACKBONE
    return row


def _experiment_files(experiments: list[str], configs_dir: str | Path | None) -> dict[str, Any]:
    # The experiment files (petl.presets.Experiment) of those experiments that have one in the configs folder.
    from petl.bench import suite

    try:
        folder = suite.find_benchmarks_dir(configs_dir)
    except FileNotFoundError:
        return {}
    known = set(suite.list_experiments(folder))
    return {name: suite.load_experiment(name, folder) for name in experiments if name in known}


def published_names(experiments: list[str], configs_dir: str | Path | None = None) -> dict[str, str]:
    """Each experiment's published row name, read from its experiment file (``published:``).

    An experiment without a file (a folder written by ``petl-run --multirun`` under another name) or
    without ``published:`` has no published row; so does every experiment when no configs folder is found.
    """
    return {name: e.published for name, e in _experiment_files(experiments, configs_dir).items() if e.published}


def family_names(experiments: list[str], configs_dir: str | Path | None = None) -> dict[str, str]:
    """Each experiment's method family, read from its experiment file (``family:``, see ``petl.presets.FAMILIES``).

    An experiment without a file or without ``family:`` has none: :meth:`Leaderboard.family` then names it
    after its method.
    """
    return {name: e.family for name, e in _experiment_files(experiments, configs_dir).items() if e.family}


def aggregate(
    records: list[RunRecord],
    results_dir: str | Path = ".",
    published: Mapping[str, str] | None = None,
    families: Mapping[str, str] | None = None,
) -> Leaderboard:
    """One row per experiment, sorted by task mean (best first).

    Per task: mean and sample standard deviation over seeds.  Task mean: the unweighted mean of the
    per-task means (V-PETL's ``task_mean``).  Group mean: the mean of the group averages (what VPT,
    NOAH and Adapter+ report).  PPT uses the task mean and the trainable parameters outside the head,
    as V-PETL does (it counts linear probing as 0M).

    Args:
        records: the runs, from :func:`collect`.
        results_dir: the folder they came from (named in the report's title).
        published: experiment name -> published row name; default: read from the experiment files
            (:func:`published_names`).
        families: experiment name -> method family; default: read from the experiment files
            (:func:`family_names`).
    """
    groups = {r.task: task_group(r.task) for r in records}
    tasks = sorted(groups, key=lambda t: _task_order_key(t, groups))
    tables = [t for t in TABLES if any(t.covers(task) for task in tasks)]
    by_experiment: dict[str, list[RunRecord]] = {}
    for record in records:
        by_experiment.setdefault(record.experiment, []).append(record)
    if published is None:
        published = published_names(list(by_experiment))
    if families is None:
        families = family_names(list(by_experiment))

    rows = []
    for name, runs in by_experiment.items():
        scores = {}
        for task in tasks:
            cell = sorted((r for r in runs if r.task == task), key=lambda r: r.seed)
            if cell:
                top1 = [float(r.result["test_top1"]) for r in cell]
                std = statistics.stdev(top1) if len(top1) > 1 else math.nan
                scores[task] = TaskScore(statistics.fmean(top1), std, tuple(r.seed for r in cell))
        group_means = {
            g: _mean([s.mean for t, s in scores.items() if groups[t] == g])
            for g in _order_groups({groups[t] for t in scores})
        }
        rows.append(
            ExperimentRow(
                experiment=name,
                runs=runs,
                scores=scores,
                task_mean=_mean([s.mean for s in scores.values()]),
                group_means=group_means,
                trainable=_mean([float(r.result["trainable_params"]) for r in runs]),
                trainable_no_head=_mean([float(r.result["trainable_params_no_head"]) for r in runs]),
                published={t.key: _published_status(runs, t, published.get(name)) for t in tables},
            )
        )
    rows.sort(key=lambda r: (-r.task_mean if not math.isnan(r.task_mean) else math.inf, r.experiment))
    # A backbone trained from random init is a different model from its pretrained namesake; say so.
    models = sorted(
        {
            str(r.result.get("model", "?")) + (" (random init)" if r.result.get("pretrained") is False else "")
            for r in records
        }
    )
    memory_kinds = sorted({str(r.result["peak_memory_kind"]) for r in records if r.result.get("peak_memory_kind")})
    board = Leaderboard(Path(results_dir), tasks, groups, rows, models, tables, memory_kinds, dict(families))
    board.columns = leaderboard_columns(board)
    for row in rows:
        row.values = {c.key: c.compute(row) for c in board.columns}
    return board


# ---------------------------------------------------------------------------------------------------
# Convergence: per-epoch val accuracy, from a run's own metrics.jsonl or its selected search trial's.


@dataclass(frozen=True)
class ValCurve:
    """Val top-1 per epoch of one training run; ``source`` is the folder whose ``metrics.jsonl`` it came from."""

    source: Path
    val_top1: tuple[float, ...]


def _read_val_history(folder: Path) -> tuple[float, ...]:
    path = folder / METRICS_FILE
    if not path.is_file():
        return ()
    values = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash: the epochs before it still count
        if isinstance(row, Mapping) and row.get("val_top1") is not None:
            values.append(float(row["val_top1"]))
    return tuple(values)


def val_curve(record: RunRecord) -> ValCurve | None:
    """The val accuracy per epoch behind one reported run, or ``None`` where none was recorded.

    A run on ``train800`` evaluated val itself, so its own ``metrics.jsonl`` is its curve.  A final run
    of the selection protocol trains on ``train800val200`` and has no val split; its curve is the one of
    the search trial it was chosen from (same configuration, one seed, on ``train800``), found through
    ``result["selection"]``: the chosen trial's ``output_dir`` ends in ``search/<point>`` under the
    experiment's folder.
    """
    own = _read_val_history(record.path.parent)
    if own:
        return ValCurve(record.path.parent, own)
    selection = record.result.get("selection")
    if not isinstance(selection, Mapping):
        return None
    for trial in selection.get("trials") or []:
        if trial.get("overrides") == selection.get("chosen") and trial.get("output_dir"):
            folder = record.path.parent.parent.joinpath(*Path(trial["output_dir"]).parts[-2:])
            history = _read_val_history(folder)
            return ValCurve(folder, history) if history else None
    return None


def tail_change(values: tuple[float, ...] | list[float], tail: float = CONVERGENCE_TAIL) -> float:
    """Val top-1 change over the last ``tail`` of the epochs: last value minus the value ``k`` epochs earlier.

    ``k = max(1, round(tail * epochs))``; NaN below two epochs.  Near zero for a converged run; 200 val
    images make one image 0.5 points.
    """
    if len(values) < 2:
        return math.nan
    k = min(len(values) - 1, max(1, round(tail * len(values))))
    return values[-1] - values[-1 - k]


def _row_curves(row: ExperimentRow) -> dict[str, list[ValCurve]]:
    # Per task, each distinct curve once: the seeds of one selected point share their search trial.
    out: dict[str, dict[Path, ValCurve]] = {}
    for run in sorted(row.runs, key=lambda r: (r.task, r.seed)):
        if (curve := val_curve(run)) is not None:
            out.setdefault(run.task, {}).setdefault(curve.source, curve)
    return {task: list(curves.values()) for task, curves in out.items()}


def _convergence(row: ExperimentRow) -> tuple[float, float]:
    # (mean over tasks of the per-task mean change, largest |change| of any curve)
    changes = {t: [tail_change(c.val_top1) for c in cs] for t, cs in _row_curves(row).items()}
    per_task = [_nanmean(v) for v in changes.values()]
    every = [abs(v) for vs in changes.values() for v in vs if not math.isnan(v)]
    return _nanmean(per_task), max(every, default=math.nan)


def _show_convergence(value: tuple[float, float]) -> Cell:
    mean, worst = value
    if math.isnan(mean):
        return "–", ""
    return f"{mean:+.2f} (max {worst:.2f})", mean


# ---------------------------------------------------------------------------------------------------
# Column declarations.  Adding a column = adding one Column(...) to leaderboard_columns.


def _round(value: float, digits: int = 4) -> float | str:
    return "" if value is None or math.isnan(value) else round(value, digits)


def _num(value: float, digits: int = 2, suffix: str = "") -> Cell:
    if value is None or math.isnan(value):
        return "–", ""
    return f"{value:.{digits}f}{suffix}", value


def _text(value: str) -> Cell:
    return value, value


def _score_cell(score: TaskScore | None) -> Cell:
    if score is None:
        return "–", ""
    text = f"{score.mean:.2f}" if math.isnan(score.std) else f"{score.mean:.2f} ± {score.std:.2f}"
    return text, score.mean


def _task_labels(tasks: list[str]) -> dict[str, str]:
    # Short names keep 19 columns readable; the full name stays when two families share a short name.
    short = {t: t.rsplit("/", 1)[-1] for t in tasks}
    counts = {s: list(short.values()).count(s) for s in short.values()}
    return {t: (s if counts[s] == 1 else t) for t, s in short.items()}


def _count_with_pct(total_key: str) -> Callable[[ExperimentRow], tuple[float, float]]:
    # (mean count, mean share of all parameters in %) of a result.json count field.
    def compute(row: ExperimentRow) -> tuple[float, float]:
        counts = [float(r.result[total_key]) for r in row.runs]
        totals = [float(r.result["total_params"]) for r in row.runs]
        return _mean(counts), _mean([100 * p / t for p, t in zip(counts, totals, strict=True)])

    return compute


def _show_count(value: tuple[float, float]) -> Cell:
    return f"{value[0] / 1e6:.4f} ({value[1]:.2f}%)", value[0]


def _selection(row: ExperimentRow, labels: dict[str, str]) -> str:
    # result.json's "selection" record (written by a search-then-final sweep): the configuration chosen on val.
    chosen: dict[str, list[str]] = {}
    for run in row.runs:
        selection = run.result.get("selection")
        if isinstance(selection, Mapping) and selection.get("chosen") is not None:
            # An empty choice: the experiment pins every searched key (a `pinned_trial` suite's one trial), or
            # a search whose only point is the defaults.
            text = _format_option(selection["chosen"]) or ("pinned" if not selection.get("space") else "defaults")
            if text not in chosen.setdefault(run.task, []):
                chosen[run.task].append(text)
    return "; ".join(f"{labels.get(t, t)}: {' | '.join(v)}" for t, v in chosen.items())


def _published_columns(board: Leaderboard, table: PublishedTable) -> list[Column]:
    """One published table's columns: its row name (or why none), per-task figures (CSV), summaries, source."""
    prefix = f"published_{table.key}"

    def of(compute: Callable[[PublishedRow], Any]) -> Callable[[ExperimentRow], Any]:
        # A figure of the row's published match; empty when there is none to show (the row column says why).
        def value(row: ExperimentRow) -> Any:
            pub = row.published.get(table.key)
            return compute(pub) if isinstance(pub, PublishedRow) else math.nan

        return value

    def million(pub: PublishedRow) -> float:
        return pub.params / 1e6 if pub.params is not None else math.nan

    def status(row: ExperimentRow) -> str:
        pub = row.published[table.key]
        return pub.method if isinstance(pub, PublishedRow) else pub

    columns = [Column(f"{prefix}_method", f"Published {table.key} row", status, _text, kind="published", detail=True)]
    columns += [
        Column(
            f"{prefix}_{column}",
            None,
            of(lambda pub, column=column: pub.top1.get(column, math.nan)),
            csv=_as_csv(f"{prefix}_{column}", None),
        )
        for column in [table.column(t) for t in board.tasks if table.covers(t)]
    ]
    columns += [
        Column(
            f"{prefix}_task_mean",
            f"Published {table.key} task mean",
            of(lambda pub: pub.task_mean),
            kind="published",
            detail=True,
        ),
        Column(
            f"{prefix}_group_mean",
            f"Published {table.key} group mean",
            of(table.group_mean),
            csv=_as_csv(f"{prefix}_group_mean", 2),
            kind="published",
            detail=True,
        ),
        Column(
            f"{prefix}_params",
            f"Published {table.key} params M",
            of(million),
            csv=_as_csv(f"{prefix}_params_M", 4),
            kind="published",
            detail=True,
        ),
        Column(
            f"{prefix}_ppt",
            f"Published {table.key} PPT",
            of(lambda pub: pub.ppt if pub.ppt is not None else math.nan),
            kind="published",
            detail=True,
        ),
        Column(f"{prefix}_source", None, lambda row: table.source),
    ]
    return columns


def _devices(row: ExperimentRow) -> str:
    # "cpu", or "cpu 9, cuda 12" when the reported runs of one row trained on different devices.
    counts = Counter(str(r.result.get("device") or "?") for r in row.runs)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{device} {n}" for device, n in sorted(counts.items()))


def _result_column(
    key: str, label: str, reduce: Callable[[list[float]], float], shown_digits: int, csv_digits: int
) -> Column:
    # A number every result.json may carry (missing or null counts as absent), reduced over the runs.
    return Column(
        key,
        label,
        lambda row: reduce([_field(r, key) for r in row.runs]),
        lambda v: _num(v, shown_digits),
        csv=_as_csv(key, csv_digits),
        detail=True,
    )


def leaderboard_columns(board: Leaderboard) -> list[Column]:
    """Every column of the leaderboard, in display and CSV order (measured first, then published tables).

    The main table (columns without ``detail``) reads left to right as: experiment, parameters, the means,
    the per-task accuracies; the details table holds configuration, selection, convergence, cost and the
    published figures.
    """
    labels = _task_labels(board.tasks)
    several_groups = len(board.group_names) > 1
    any_selection = any("selection" in r.result for row in board.rows for r in row.runs)
    tail_pct = round(100 * CONVERGENCE_TAIL)
    columns = [
        Column(
            "experiment",
            "Experiment",
            lambda row: (row.experiment, board.complete(row)),
            show=lambda v: (v[0] if v[1] else f"{v[0]} *", v[0]),
            csv=lambda v: {"experiment": v[0]},
            kind="info",
        ),
        Column(
            "method", None, lambda row: ", ".join(dict.fromkeys(str(r.result.get("method", "?")) for r in row.runs))
        ),
        Column(
            "family",
            "Family",
            board.family,
            _text,
            kind="info",
            note="**Family**: the kind of method, from the experiment file's `family:` ("
            + "; ".join(f"{f}: {FAMILIES[f]}" if f in FAMILIES else f for f in board.family_order)
            + "). The plots give each family one marker and colour, and one panel of learning curves.",
            detail=True,
        ),
        Column("runs", None, lambda row: len(row.runs)),
        Column("tasks_done", None, lambda row: f"{len(row.scores)}/{len(board.tasks)}"),
        Column(
            "trainable",
            "Trainable M (%)",
            _count_with_pct("trainable_params"),
            _show_count,
            csv=lambda v: {"trainable_M": _round(v[0] / 1e6, 6), "trainable_pct": _round(v[1])},
        ),
        Column(
            "trainable_no_head",
            "Trainable w/o head M (%)",
            _count_with_pct("trainable_params_no_head"),
            _show_count,
            csv=lambda v: {"trainable_no_head_M": _round(v[0] / 1e6, 6), "trainable_no_head_pct": _round(v[1])},
            detail=True,
        ),
        Column("task_mean", "Task mean", lambda row: row.task_mean),
    ]
    columns += [
        Column(
            f"group:{g}",
            f"{g.capitalize()} mean" if several_groups else None,
            lambda row, g=g: row.group_means.get(g, math.nan),
            csv=_as_csv(f"group_mean_{g}"),
        )
        for g in board.group_names
    ]
    columns += [
        Column("group_mean", "Group mean", lambda row: row.group_mean),
        Column("ppt", "PPT", lambda row: ppt(row.task_mean, row.trainable_no_head)),
    ]
    columns += [
        Column(
            f"task:{t}",
            labels[t],
            lambda row, t=t: row.scores.get(t),
            _score_cell,
            csv=lambda score, t=t: {
                f"{t}_top1_mean": _round(score.mean) if score else "",
                f"{t}_top1_std": _round(score.std) if score else "",
                f"{t}_seeds": " ".join(map(str, score.seeds)) if score else "",
            },
        )
        for t in board.tasks
    ]
    columns.append(
        Column(
            "val_tail_change",
            f"Val Δ last {CONVERGENCE_TAIL:.0%} ep",
            _convergence,
            _show_convergence,
            csv=lambda v: {
                f"val_change_last{tail_pct}_mean": _round(v[0]),
                f"val_change_last{tail_pct}_max_abs": _round(v[1]),
            },
            note=f"**Val Δ last {CONVERGENCE_TAIL:.0%} ep**: convergence check, the val top-1 change (points) over "
            f"the last {CONVERGENCE_TAIL:.0%} of the epochs, mean over tasks (in brackets the largest absolute change "
            "of any one curve, the figure to read: opposite changes on two tasks cancel in the mean): from each "
            "run's own per-epoch val accuracy (metrics.jsonl), or, for a final run trained on train+val, from the "
            "search trial it was selected from (one seed); – where none was recorded.",
            detail=True,
        )
    )
    if any(r.result.get("device") for row in board.rows for r in row.runs):
        columns.append(
            Column(
                "device",
                "Device",
                _devices,
                _text,
                kind="info",
                note="**Device**: where the reported runs trained (result.json's `device`; with several, how many "
                "runs each). Train s/run, Images/s and Peak MB compare only between rows on the same device.",
                detail=True,
            )
        )
    columns += [
        _result_column("train_seconds", "Train s/run", _nanmean, 1, 2),
        _result_column("images_per_second", "Images/s", _nanmean, 0, 1),
        _result_column("peak_memory_mb", "Peak MB", _nanmax, 0, 1),
    ]
    for table in board.tables:
        columns += _published_columns(board, table)
    # Long texts last, where they can wrap without pushing a number off the screen.
    columns.append(
        Column(
            "config",
            "petl config",
            lambda row: " | ".join(dict.fromkeys(_describe_run(r) for r in row.runs)),
            _text,
            kind="info",
            detail=True,
        )
    )
    if any_selection:
        columns.append(
            Column(
                "selected_on_val",
                "Selected on val",
                lambda row: _selection(row, labels),
                _text,
                kind="info",
                note="**Selected on val**: per task, the configuration the search chose on the validation split "
                "(result.json's `selection` record); the task's scores are of that configuration's final runs.",
                detail=True,
            )
        )
    return columns


# ---------------------------------------------------------------------------------------------------
# Writers: one flat CSV for machines, display tables (text + sort key per cell) for Markdown and HTML.


def csv_records(board: Leaderboard) -> list[dict[str, Any]]:
    """The leaderboard as flat records (numbers unformatted, published figures prefixed ``published_``)."""
    out = []
    for row in board.rows:
        record: dict[str, Any] = {}
        for column in board.columns:
            record.update(column.csv_fields(row.values[column.key]))
        out.append(record)
    return out


def csv_text(board: Leaderboard) -> str:
    """``leaderboard.csv``'s contents."""
    records = csv_records(board)
    columns = list(dict.fromkeys(k for rec in records for k in rec))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    return buffer.getvalue()


DETAILS_TITLE = "Details: family, convergence, cost, configuration and selection"


def display_table(board: Leaderboard) -> Table:
    """The main leaderboard table: every labelled column that is not a detail, in declaration order."""
    return _rendered(board, [c for c in board.columns if c.label is not None and not c.detail])


def details_table(board: Leaderboard) -> Table:
    """The details table: the experiment, then every labelled detail column (config, selection, cost, published)."""
    experiment = next(c for c in board.columns if c.key == "experiment")
    shown = [experiment, *(c for c in board.columns if c.label is not None and c.detail)]
    return _rendered(board, shown, DETAILS_TITLE)


def _rendered(board: Leaderboard, shown: list[Column], title: str = "") -> Table:
    headers = [Header(c.key, c.label, c.kind) for c in shown]
    return Table(headers, [[c.show(row.values[c.key]) for c in shown] for row in board.rows], title)


def published_tables(board: Leaderboard) -> list[Table]:
    """Per-task published figures of each matched row, one table per published source."""
    out = []
    for table in board.tables:
        covered = [t for t in board.tasks if table.covers(t)]
        labels = _task_labels(covered)
        headers = [
            Header("experiment", "petl experiment", "info"),
            Header("published_method", "Published row", "published"),
            *[Header(f"published:{t}", labels[t], "published") for t in covered],
            Header("published_task_mean", "Task mean", "published"),
            Header("published_group_mean", "Group mean", "published"),
            Header("published_params", "Params M", "published"),
            Header("published_ppt", "PPT", "published"),
        ]
        rows = []
        for row in board.rows:
            pub = row.published.get(table.key)
            if not isinstance(pub, PublishedRow):
                continue
            rows.append(
                [
                    (row.experiment, row.experiment),
                    (pub.method, pub.method),
                    *[_num(pub.top1.get(table.column(t), math.nan), 1) for t in covered],
                    _num(pub.task_mean),
                    _num(table.group_mean(pub)),
                    _num(pub.params / 1e6 if pub.params is not None else math.nan),
                    _num(pub.ppt if pub.ppt is not None else math.nan),
                ]
            )
        if rows:
            title = f"Published per-task figures: {table.title} (not measured by petl)"
            out.append(Table(headers, rows, title, table.source))
    return out


def notes(board: Leaderboard) -> list[str]:
    """The legend every rendering carries: what each summary column means and where published figures come from."""
    members = {g: [t.rsplit("/", 1)[-1] for t in board.tasks if board.groups[t] == g] for g in board.group_names}
    group_text = "; ".join(f"{g}: {', '.join(names)}" for g, names in members.items())
    lines = [
        f"Measured by petl on {', '.join(board.models)}; top-1 test accuracy (%) as mean ± sample standard "
        "deviation over seeds (no ± with one seed).",
        f"**Task mean** = unweighted mean over the {len(board.tasks)} tasks of the per-task means (V-PETL's "
        "`task_mean`). **Group mean** = mean of the group averages (as VPT, NOAH and Adapter+ report), "
        f"groups — {group_text}.",
        "**PPT** = M·exp(−log10(P/C + 1)), M = task mean as a fraction, P = trainable parameters without the "
        "head (mean over runs), C = 10^7 (V-PETL Bench).",
        "Trainable counts are means over runs (the head's size follows each task's classes); % is of all "
        "parameters. Train s/run and Images/s are means over runs (as the engine ran them, feature caching "
        "included, the test pass not); Peak MB is the maximum over runs"
        + (f" ({', '.join(board.memory_kinds)})." if board.memory_kinds else "."),
        "`*` after an experiment: it has not run on every task, or with every seed, yet, so its means cover "
        "fewer tasks or seeds.",
    ]
    if board.compute is not None:
        lines.append(board.compute.line())
    lines += [c.note for c in board.columns if c.note]
    for table in board.tables:
        lines.append(
            f"**Published {table.key}** columns: {table.title}; source: {table.source}. Figures published by "
            "others, not measured by petl; they are never mixed into the measured columns. They are shown only "
            f"beside experiments run on the published backbone (`{table.backbone}`, pretrained): otherwise the "
            f'row column says "{DIFFERENT_BACKBONE}"; "{NO_PUBLISHED_ROW}" means the experiment file names no '
            "row of this table (`published:`)."
        )
    return lines


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def _md_table(table: Table) -> list[str]:
    lines = [
        "| " + " | ".join(_md_escape(h.label) for h in table.headers) + " |",
        "|" + "|".join("---" if h.kind == "info" else "---:" for h in table.headers) + "|",
    ]
    lines += ["| " + " | ".join(_md_escape(text) for text, _ in cells) + " |" for cells in table.rows]
    return lines


def _title(board: Leaderboard) -> str:
    return f"petl leaderboard: {board.results_dir.name}"


def _summary(board: Leaderboard) -> str:
    runs = sum(len(r.runs) for r in board.rows)
    return f"{len(board.rows)} experiments, {len(board.tasks)} tasks, {runs} runs."


def markdown(board: Leaderboard) -> str:
    """``leaderboard.md``: the main table, the details table, the legend, then the published per-task tables."""
    lines = [
        f"# {_title(board)}",
        "",
        _summary(board),
        "",
        *_md_table(display_table(board)),
        "",
        f"## {DETAILS_TITLE}",
        "",
        *_md_table(details_table(board)),
        "",
        "## Legend",
        "",
        *[f"- {n}" for n in notes(board)],
    ]
    for table in published_tables(board):
        lines += ["", f"## {table.title}", "", f"Source: {table.source}.", "", *_md_table(table)]
    return "\n".join(lines) + "\n"


def _family_legend(board: Leaderboard) -> dict[str, str]:
    # Each family present -> what its methods train (empty for a family petl.presets.FAMILIES does not know).
    return {f: FAMILIES.get(f, "") for f in board.family_order}


def pareto_png(board: Leaderboard) -> bytes:
    """``pareto.png``: task-mean top-1 against trainable parameters, one marker and colour per method family."""
    from petl.bench.plot import Point, render_pareto  # matplotlib loads only when a plot is drawn

    points = [Point(r.experiment, r.trainable, r.task_mean, board.complete(r), board.family(r)) for r in board.rows]
    return render_pareto(points, len(board.tasks), board.models, _family_legend(board))


def learning_curves(board: Leaderboard, task: str | None = None) -> tuple[str, dict[str, list[float]]] | None:
    """Val top-1 per epoch of every experiment on one task, averaged over that task's curves (seeds).

    Args:
        board: the leaderboard.
        task: the task to show; default: the first task, in the leaderboard's order, with the most
            experiments that recorded a curve.

    Returns:
        ``(task, {experiment: val top-1 per epoch})``, or ``None`` when no run recorded a val curve.

    """
    per_row = {row.experiment: _row_curves(row) for row in board.rows}
    if task is None:
        counts = {t: sum(t in curves for curves in per_row.values()) for t in board.tasks}
        task = max(board.tasks, key=lambda t: counts[t], default=None)  # max keeps the first of equal counts
        if task is None or counts[task] == 0:
            return None
    out = {}
    for experiment, curves in per_row.items():
        if curves.get(task):
            # Curves of one configuration have as many epochs; a shorter one (a hand-edited file) trims the rest.
            length = min(len(c.val_top1) for c in curves[task])
            out[experiment] = [statistics.fmean(c.val_top1[i] for c in curves[task]) for i in range(length)]
    return (task, out) if out else None


def learning_curves_png(board: Leaderboard) -> bytes | None:
    """``learning_curves.png``: val top-1 per epoch on one task, a panel per method family; ``None`` without curves."""
    found = learning_curves(board)
    if found is None:
        return None
    from petl.bench.plot import render_curves

    task, curves = found
    family_of = {row.experiment: board.family(row) for row in board.rows}
    return render_curves(curves, task, board.models, family_of, _family_legend(board))


def write_report(
    results_dir: str | Path, out_dir: str | Path | None = None, configs_dir: str | Path | None = None
) -> Leaderboard:
    """Build the leaderboard of ``results_dir`` and write md, csv, html and pareto.png into ``out_dir``.

    ``learning_curves.png`` (val top-1 per epoch on one task, :func:`learning_curves`) is written too
    when the runs recorded per-epoch val accuracy.

    Args:
        results_dir: a results root holding ``<task>/<experiment>/seed<k>/result.json`` files.
        out_dir: where to write (default: ``results_dir``).
        configs_dir: the folder of experiment files that name each experiment's published row
            (default: petl's own, see :func:`petl.bench.suite.find_benchmarks_dir`).

    Returns:
        The leaderboard.

    Raises:
        FileNotFoundError: no result.json under ``results_dir``.

    """
    from petl.bench.html import render_html

    results_dir = Path(results_dir)
    records = collect(results_dir)
    if not records:
        raise FileNotFoundError(f"no result.json under {results_dir}")
    experiments = sorted({r.experiment for r in records})
    board = aggregate(
        records, results_dir, published_names(experiments, configs_dir), family_names(experiments, configs_dir)
    )
    board.compute = compute_spent(results_dir)
    out = Path(out_dir) if out_dir is not None else results_dir
    png = pareto_png(board)
    curves_png = learning_curves_png(board)
    figures = [("Accuracy against trainable parameters", png)]
    if curves_png is not None:
        figures.append(("Learning curves", curves_png))
    html = render_html(
        _title(board),
        display_table(board),
        details_table(board),
        notes(board),
        figures,
        published_tables(board),
        _summary(board),
    )
    # Two sweeps finishing together both rebuild the report; each file is renamed into place whole.
    write_text(out / "leaderboard.csv", csv_text(board))
    write_text(out / "leaderboard.md", markdown(board))
    write_atomic(out / "pareto.png", lambda tmp: tmp.write_bytes(png))
    write_text(out / "leaderboard.html", html)
    if curves_png is not None:
        write_atomic(out / "learning_curves.png", lambda tmp: tmp.write_bytes(curves_png))
    return board
