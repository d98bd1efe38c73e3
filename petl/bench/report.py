"""Leaderboards built from results folders alone.

``collect`` reads every ``result.json`` under a results root (written by ``petl-bench`` or by
``petl-run --multirun`` into the same ``<task>/<experiment>/seed<k>/`` layout); ``aggregate`` turns
them into one row per experiment; ``write_report`` writes ``leaderboard.md``, ``leaderboard.csv``,
``leaderboard.html`` and ``pareto.png``.  Reports only read run folders, so they are safe to build
while a sweep is still writing.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from petl.bench.published import (
    EXPERIMENT_TO_PUBLISHED,
    TABLES,
    PublishedRow,
    PublishedTable,
    ppt,
    table_for,
    vtab_group,
)

# Groups in the order benchmarks print them; unknown groups follow alphabetically.
GROUP_ORDER = ("natural", "specialized", "structured", "fgvc")
_SEED_DIR = re.compile(r"^seed(\d+)$")


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
    for path in sorted(Path(results_dir).rglob("result.json")):
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

    The dataset registry is asked first; VTAB and FGVC names fall back to the published convention so
    that a report can be built on a machine without the data package's registry entry for a task.
    """
    try:
        from petl.data import get_info

        return str(get_info(task).group)
    except (ImportError, KeyError, ValueError):
        pass
    if (group := vtab_group(task)) is not None:
        return group
    return "fgvc" if task.startswith("fgvc/") else "other"


@dataclass(frozen=True)
class TaskScore:
    """Top-1 (%) of one experiment on one task over its seeds; ``std`` is NaN below two seeds."""

    mean: float
    std: float
    seeds: tuple[int, ...]


@dataclass
class ExperimentRow:
    """One leaderboard row: an experiment's configuration, cost and scores."""

    experiment: str
    method: str
    config: str
    runs: int
    scores: dict[str, TaskScore]
    trainable: float
    trainable_pct: float
    trainable_no_head: float
    trainable_no_head_pct: float
    task_mean: float
    group_means: dict[str, float]
    group_mean: float
    ppt: float
    train_seconds: float
    images_per_second: float
    peak_memory_mb: float
    published: dict[str, PublishedRow] = field(default_factory=dict)


@dataclass
class Leaderboard:
    """Everything a report renders: the tasks and groups found, and one row per experiment."""

    results_dir: Path
    tasks: list[str]
    groups: dict[str, str]
    rows: list[ExperimentRow]
    models: list[str]
    tables: list[PublishedTable]
    memory_kinds: list[str] = field(default_factory=list)

    @property
    def group_names(self) -> list[str]:
        """Groups present, in benchmark order."""
        return _order_groups(set(self.groups.values()))

    def complete(self, row: ExperimentRow) -> bool:
        """Whether ``row`` has a score on every task of the leaderboard."""
        return len(row.scores) == len(self.tasks)


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


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _nanmean(values: list[float]) -> float:
    return _mean([v for v in values if not math.isnan(v)])


def _nanmax(values: list[float]) -> float:
    return max((v for v in values if not math.isnan(v)), default=math.nan)


def _format_option(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ",".join(_format_option(v) for v in value) + "]"
    return str(value)


def _describe_run(record: RunRecord) -> str:
    """Method options (minus the per-task class count) and the learning rate / epochs of one run."""
    options = {k: v for k, v in (record.result.get("method_config") or {}).items() if k != "num_classes"}
    text = ", ".join(f"{k}={_format_option(v)}" for k, v in sorted(options.items()))
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


def aggregate(records: list[RunRecord], results_dir: str | Path = ".") -> Leaderboard:
    """One row per experiment, sorted by task mean (best first).

    Per task: mean and sample standard deviation over seeds.  Task mean: the unweighted mean of the
    per-task means (V-PETL's ``task_mean``).  Group mean: the mean of the group averages (what VPT,
    NOAH and Adapter+ report).  PPT uses the task mean and the trainable parameters outside the head,
    as V-PETL does (it counts linear probing as 0M).
    """
    groups = {r.task: task_group(r.task) for r in records}
    tasks = sorted(groups, key=lambda t: _task_order_key(t, groups))
    tables = [t for t in TABLES if any(t.covers(task) for task in tasks)]
    by_experiment: dict[str, list[RunRecord]] = {}
    for record in records:
        by_experiment.setdefault(record.experiment, []).append(record)

    rows = []
    for name, runs in by_experiment.items():
        scores = {}
        for task in tasks:
            cell = sorted((r for r in runs if r.task == task), key=lambda r: r.seed)
            if cell:
                top1 = [float(r.result["test_top1"]) for r in cell]
                std = statistics.stdev(top1) if len(top1) > 1 else math.nan
                scores[task] = TaskScore(statistics.fmean(top1), std, tuple(r.seed for r in cell))
        task_mean = _mean([s.mean for s in scores.values()])
        group_means = {
            g: _mean([s.mean for t, s in scores.items() if groups[t] == g])
            for g in _order_groups({groups[t] for t in scores})
        }
        trainable = [float(r.result["trainable_params"]) for r in runs]
        no_head = [float(r.result["trainable_params_no_head"]) for r in runs]
        totals = [float(r.result["total_params"]) for r in runs]
        configs = list(dict.fromkeys(_describe_run(r) for r in runs))
        methods = list(dict.fromkeys(str(r.result.get("method", "?")) for r in runs))
        published = {}
        if name in EXPERIMENT_TO_PUBLISHED:
            for table in tables:
                row = table.rows().get(EXPERIMENT_TO_PUBLISHED[name])
                if row is not None:
                    published[table.key] = row
        rows.append(
            ExperimentRow(
                experiment=name,
                method=", ".join(methods),
                config=" | ".join(configs),
                runs=len(runs),
                scores=scores,
                trainable=_mean(trainable),
                trainable_pct=_mean([100 * p / t for p, t in zip(trainable, totals, strict=True)]),
                trainable_no_head=_mean(no_head),
                trainable_no_head_pct=_mean([100 * p / t for p, t in zip(no_head, totals, strict=True)]),
                task_mean=task_mean,
                group_means=group_means,
                group_mean=_mean(list(group_means.values())),
                ppt=ppt(task_mean, _mean(no_head)),
                train_seconds=_nanmean([_field(r, "train_seconds") for r in runs]),
                images_per_second=_nanmean([_field(r, "images_per_second") for r in runs]),
                peak_memory_mb=_nanmax([_field(r, "peak_memory_mb") for r in runs]),
                published=published,
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
    return Leaderboard(Path(results_dir), tasks, groups, rows, models, tables, memory_kinds)


# ---------------------------------------------------------------------------------------------------
# Tables: one flat CSV for machines, one display table (text + sort key per cell) for Markdown and HTML.


def _round(value: float, digits: int = 4) -> float | str:
    return "" if value is None or math.isnan(value) else round(value, digits)


def csv_records(board: Leaderboard) -> list[dict[str, Any]]:
    """The leaderboard as flat records (numbers unformatted, published figures prefixed ``published_``)."""
    out = []
    for row in board.rows:
        rec: dict[str, Any] = {
            "experiment": row.experiment,
            "method": row.method,
            "config": row.config,
            "runs": row.runs,
            "tasks_done": f"{len(row.scores)}/{len(board.tasks)}",
            "trainable_M": _round(row.trainable / 1e6, 6),
            "trainable_pct": _round(row.trainable_pct),
            "trainable_no_head_M": _round(row.trainable_no_head / 1e6, 6),
            "trainable_no_head_pct": _round(row.trainable_no_head_pct),
        }
        for task in board.tasks:
            score = row.scores.get(task)
            rec[f"{task}_top1_mean"] = _round(score.mean) if score else ""
            rec[f"{task}_top1_std"] = _round(score.std) if score else ""
            rec[f"{task}_seeds"] = " ".join(map(str, score.seeds)) if score else ""
        rec["task_mean"] = _round(row.task_mean)
        for group in board.group_names:
            rec[f"group_mean_{group}"] = _round(row.group_means.get(group, math.nan))
        rec["group_mean"] = _round(row.group_mean)
        rec["ppt"] = _round(row.ppt)
        rec["train_seconds"] = _round(row.train_seconds, 2)
        rec["images_per_second"] = _round(row.images_per_second, 1)
        rec["peak_memory_mb"] = _round(row.peak_memory_mb, 1)
        for table in board.tables:
            pub = row.published.get(table.key)
            prefix = f"published_{table.key}"
            rec[f"{prefix}_method"] = pub.method if pub else ""
            for task in board.tasks:
                if table.covers(task):
                    rec[f"{prefix}_{table.column(task)}"] = pub.top1.get(table.column(task), "") if pub else ""
            rec[f"{prefix}_task_mean"] = pub.task_mean if pub else ""
            rec[f"{prefix}_group_mean"] = _round(table.group_mean(pub), 2) if pub else ""
            rec[f"{prefix}_params_M"] = _round(pub.params / 1e6, 4) if pub and pub.params is not None else ""
            rec[f"{prefix}_ppt"] = pub.ppt if pub and pub.ppt is not None else ""
            rec[f"{prefix}_source"] = table.source
        out.append(rec)
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


@dataclass(frozen=True)
class Column:
    """A display column: a stable key (for the HTML's sort links), its label, and measured/published/info."""

    key: str
    label: str
    kind: str = "measured"


Cell = tuple[str, float | str]  # (display text, sort key)


def _num(value: float, digits: int = 2, suffix: str = "") -> Cell:
    if value is None or math.isnan(value):
        return "–", ""
    return f"{value:.{digits}f}{suffix}", value


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


def display_table(board: Leaderboard) -> tuple[list[Column], list[list[Cell]]]:
    """The main leaderboard table: measured columns first, then each published table's summary columns."""
    labels = _task_labels(board.tasks)
    columns = [
        Column("experiment", "Experiment", "info"),
        Column("config", "petl config", "info"),
        Column("trainable", "Trainable M (% of total)"),
        Column("trainable_no_head", "Trainable w/o head M (%)"),
        *[Column(f"task:{t}", labels[t]) for t in board.tasks],
        Column("task_mean", "Task mean"),
    ]
    several_groups = len(board.group_names) > 1
    if several_groups:
        columns += [Column(f"group:{g}", f"{g.capitalize()} mean") for g in board.group_names]
    columns += [
        Column("group_mean", "Group mean"),
        Column("ppt", "PPT"),
        Column("train_seconds", "Train s/run"),
        Column("images_per_second", "Images/s"),
        Column("peak_memory_mb", "Peak MB"),
    ]
    for table in board.tables:
        columns += [
            Column(f"published_{table.key}_method", f"Published {table.key} row", "published"),
            Column(f"published_{table.key}_task_mean", f"Published {table.key} task mean", "published"),
            Column(f"published_{table.key}_group_mean", f"Published {table.key} group mean", "published"),
            Column(f"published_{table.key}_params", f"Published {table.key} params M", "published"),
            Column(f"published_{table.key}_ppt", f"Published {table.key} PPT", "published"),
        ]

    rows = []
    for row in board.rows:
        name = row.experiment if board.complete(row) else f"{row.experiment} *"
        cells: list[Cell] = [
            (name, row.experiment),
            (row.config, row.config),
            (f"{row.trainable / 1e6:.4f} ({row.trainable_pct:.2f}%)", row.trainable),
            (f"{row.trainable_no_head / 1e6:.4f} ({row.trainable_no_head_pct:.2f}%)", row.trainable_no_head),
            *[_score_cell(row.scores.get(t)) for t in board.tasks],
            _num(row.task_mean),
        ]
        if several_groups:
            cells += [_num(row.group_means.get(g, math.nan)) for g in board.group_names]
        cells += [
            _num(row.group_mean),
            _num(row.ppt),
            _num(row.train_seconds, 1),
            _num(row.images_per_second, 0),
            _num(row.peak_memory_mb, 0),
        ]
        for table in board.tables:
            pub = row.published.get(table.key)
            if pub is None:
                cells += [("–", "")] * 5
                continue
            cells += [
                (pub.method, pub.method),
                _num(pub.task_mean),
                _num(table.group_mean(pub)),
                _num(pub.params / 1e6 if pub.params is not None else math.nan),
                _num(pub.ppt if pub.ppt is not None else math.nan),
            ]
        rows.append(cells)
    return columns, rows


def published_tables(board: Leaderboard) -> list[tuple[PublishedTable, list[Column], list[list[Cell]]]]:
    """Per-task published figures of each matched row, one table per published source."""
    out = []
    for table in board.tables:
        covered = [t for t in board.tasks if table.covers(t)]
        labels = _task_labels(covered)
        columns = [
            Column("experiment", "petl experiment", "info"),
            Column("published_method", "Published row", "published"),
            *[Column(f"published:{t}", labels[t], "published") for t in covered],
            Column("published_task_mean", "Task mean", "published"),
            Column("published_group_mean", "Group mean", "published"),
            Column("published_params", "Params M", "published"),
            Column("published_ppt", "PPT", "published"),
        ]
        rows = []
        for row in board.rows:
            pub = row.published.get(table.key)
            if pub is None:
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
            out.append((table, columns, rows))
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
        "head (mean over tasks), C = 10^7 (V-PETL Bench).",
        "Trainable counts are means over runs (the head's size follows each task's classes); % is of all "
        "parameters. Train s/run and Images/s are means over runs (as the engine ran them, feature caching "
        "included); Peak MB is the maximum over runs"
        + (f" ({', '.join(board.memory_kinds)})." if board.memory_kinds else "."),
        "`*` after an experiment: it has not run on every task yet, so its means cover fewer tasks.",
    ]
    for table in board.tables:
        lines.append(
            f"**Published {table.key}** columns: {table.title}; source: {table.source}. Figures published by "
            "others on a different backbone, not measured by petl; they are never mixed into the measured columns."
        )
    return lines


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def _md_table(columns: list[Column], rows: list[list[Cell]]) -> list[str]:
    lines = [
        "| " + " | ".join(_md_escape(c.label) for c in columns) + " |",
        "|" + "|".join("---" if c.kind == "info" else "---:" for c in columns) + "|",
    ]
    lines += ["| " + " | ".join(_md_escape(text) for text, _ in cells) + " |" for cells in rows]
    return lines


def markdown(board: Leaderboard) -> str:
    """``leaderboard.md``: the main table, the legend, then the published per-task tables."""
    runs = sum(r.runs for r in board.rows)
    lines = [
        f"# petl leaderboard: {board.results_dir.name}",
        "",
        f"{len(board.rows)} experiments, {len(board.tasks)} tasks, {runs} runs.",
        "",
        *_md_table(*display_table(board)),
        "",
        *[f"- {n}" for n in notes(board)],
    ]
    for table, columns, rows in published_tables(board):
        lines += [
            "",
            f"## Published per-task figures: {table.title} (not measured by petl)",
            "",
            f"Source: {table.source}.",
            "",
            *_md_table(columns, rows),
        ]
    return "\n".join(lines) + "\n"


def write_report(results_dir: str | Path, out_dir: str | Path | None = None) -> Leaderboard:
    """Build the leaderboard of ``results_dir`` and write md, csv, html and pareto.png into ``out_dir``.

    Args:
        results_dir: a results root holding ``<task>/<experiment>/seed<k>/result.json`` files.
        out_dir: where to write (default: ``results_dir``).

    Returns:
        The leaderboard.

    Raises:
        FileNotFoundError: no result.json under ``results_dir``.

    """
    from petl.bench.html import render_html
    from petl.bench.plot import render_pareto

    results_dir = Path(results_dir)
    records = collect(results_dir)
    if not records:
        raise FileNotFoundError(f"no result.json under {results_dir}")
    board = aggregate(records, results_dir)
    out = Path(out_dir) if out_dir is not None else results_dir
    out.mkdir(parents=True, exist_ok=True)
    png = render_pareto(board)
    _write_atomic(out / "leaderboard.csv", csv_text(board).encode())
    _write_atomic(out / "leaderboard.md", markdown(board).encode())
    _write_atomic(out / "pareto.png", png)
    _write_atomic(out / "leaderboard.html", render_html(board, png).encode())
    return board


def _write_atomic(path: Path, data: bytes) -> None:
    # Two sweeps finishing together both rebuild the report; a rename makes each file whole, never interleaved.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
