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
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from petl.bench import ranking
from petl.bench.board import (
    DIFFERENT_BACKBONE,
    NO_PUBLISHED_ROW,
    Column,
    ExperimentRow,
    Leaderboard,
    Plan,
    TaskScore,
    backbone,
    input_size,
    order_groups,
    show_number,
    sized_models,
    suite_size,
)
from petl.bench.collect import (
    Compute,
    RunRecord,
    collect,
    compute_spent,
    mean,
    nanmean,
    read_all,
    task_group,
)
from petl.bench.columns import leaderboard_columns, task_labels
from petl.bench.curves import (
    CONVERGENCE_TAIL,
    ValCurve,
    cut_curves,
    learning_curves,
    run_curves,
    tail_change,
    val_curve,
)
from petl.bench.notes import CD_FILE, COMPARISON_TITLE, comparison_lines, notes, progress, published_ranking
from petl.bench.published import (
    TABLES,
    PublishedRow,
    PublishedTable,
    table_for,
)
from petl.bench.table import Header, Table, markdown_lines, md_escape
from petl.presets import FAMILIES
from petl.store.files import write_atomic, write_text
from petl.utils.text import csv_cell, plural, shown

# Re-exported: the report's public names, wherever they are declared.
__all__ = [
    "CONVERGENCE_TAIL",
    "Column",
    "Compute",
    "ExperimentRow",
    "Leaderboard",
    "Plan",
    "RunRecord",
    "TaskScore",
    "ValCurve",
    "aggregate",
    "build_board",
    "collect",
    "compute_spent",
    "csv_text",
    "learning_curves",
    "leaderboard_columns",
    "markdown",
    "plan_of",
    "progress",
    "published_ranking",
    "tail_change",
    "task_group",
    "val_curve",
    "write_report",
]


def _task_order_key(task: str, groups: dict[str, str]) -> tuple:
    # Benchmarks print tasks group by group and, within a group, in their published column order.
    order = order_groups(set(groups.values()))
    table = table_for(task)
    columns = table.columns() if table else []
    column = table.column(task) if table else ""
    position = columns.index(column) if column in columns else len(columns)
    return order.index(groups[task]), position, task


def _published_status(runs: list[RunRecord], table: PublishedTable, row_name: str | None) -> PublishedRow | str:
    """The published row to show beside ``runs`` in ``table``, or why none is shown."""
    row = table.rows().get(row_name) if row_name else None
    if row is None:
        return NO_PUBLISHED_ROW
    # Published figures sit beside petl's only when petl measured on the same pretrained backbone.
    covered = [r for r in runs if table.covers(r.task)] or runs
    # At its resolution too: the backbone at another img_size is another model than the one the figures came from.
    if any(
        r.result.model != table.backbone
        or r.result.pretrained is False
        or input_size(r.result) not in (None, table.img_size)
        for r in covered
    ):
        return DIFFERENT_BACKBONE
    return row


def _experiment_files(experiments: list[str], configs_dir: str | Path | None) -> dict[str, Any]:
    # The experiment files (petl.presets.Experiment) of those experiments that have one in the configs folder.
    from petl.bench import suite

    try:
        folder = suite.configs_dir(configs_dir)
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


class MixedCellError(ValueError):
    """A leaderboard cell whose seeds are not seeds of one run (another backbone, epoch count, dataset...)."""


def check_cell(cell: list[RunRecord]) -> None:
    """Refuse a cell (one task, one experiment) whose runs differ in more than their seed.

    Two suites run into one folder, or a suite edited between sweeps, can leave a cell whose "seeds" ran on
    different backbones or epoch counts; their mean and spread would read as seed noise.  The comparison is
    :func:`petl.train.output_dir.seed_difference`, the one that decides whether a folder holds a given run.

    Raises:
        MixedCellError: naming the cell, the two runs and up to three differences.

    """
    from petl.train.output_dir import seed_difference

    first = cell[0]
    for other in cell[1:]:
        difference = seed_difference(first.result, other.result)
        if difference:
            raise MixedCellError(
                f"{first.task} {first.experiment}: {other.path} is not another seed of {first.path} "
                f"({difference}); report the two suites' folders apart, or move one run aside"
            )


def aggregate(
    records: list[RunRecord],
    results_dir: str | Path = ".",
    published: Mapping[str, str] | None = None,
    families: Mapping[str, str] | None = None,
    plan: Plan | None = None,
    compute: Compute | None = None,
    skipped: Sequence[Path] = (),
) -> Leaderboard:
    """One row per experiment, sorted by task mean (best first).

    Per task: mean and sample standard deviation over seeds (runs that differ in more than the seed are refused,
    :func:`check_cell`).  Task mean: the unweighted mean of the
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
        plan: what the suite the runs came from sets out to run (:func:`plan_of`): its tasks get a column
            even before any of their runs finish, rows are complete only with all its tasks and seeds, and
            the legend says how far it got (:func:`progress`).
        compute: the compute the runs spent (:func:`compute_spent`), for the legend.
        skipped: the result files left out as damaged or incomplete, for the legend.
    """
    check_plan_model(records, results_dir, plan)
    groups = {r.task: task_group(r.task) for r in records}
    groups.update({t: task_group(t) for t in (plan.tasks if plan else ()) if t not in groups})
    tasks = sorted(groups, key=lambda t: _task_order_key(t, groups))
    # The published tables of the tasks the means count: a run of a task outside the suite brings in none of its own.
    tables = [t for t in TABLES if any(t.covers(task) for task in tasks if plan is None or task in plan.tasks)]
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
        # The curves of the suite's seeds only, as the cells' means: a rerun of another seed is no part of ↑.
        curves = run_curves([r for r in runs if plan is None or r.seed in plan.seeds])
        for task in tasks:
            cell = sorted((r for r in runs if r.task == task), key=lambda r: r.seed)
            # With a plan, a cell is over the suite's seeds: a run of another seed (a rerun by hand) is left out, as
            # a task outside the suite is left out of the means, and the cell marked (Leaderboard.more_seeds).
            outside = tuple(r.seed for r in cell if plan is not None and r.seed not in plan.seeds)
            cell = [r for r in cell if r.seed not in outside]
            if cell:
                check_cell(cell)
                top1 = [float(r.result.test_top1) for r in cell]
                std = statistics.stdev(top1) if len(top1) > 1 else math.nan
                stuck = tuple(r.seed for r in cell if r.not_learned)
                far = ranking.far_seeds({r.seed: float(r.result.test_top1) for r in cell})
                change = nanmean([tail_change(c.val_top1, c.epochs) for c in curves.get(task, [])])
                seeds = tuple(r.seed for r in cell)
                scores[task] = TaskScore(statistics.fmean(top1), std, seeds, stuck, far, change, outside)
        # With a plan, the means are over the suite's tasks: a run of another task in the folder would make this row's
        # task mean one over more tasks than the other rows', sorted and plotted among them as if it were not.
        counted = {t: s for t, s in scores.items() if plan is None or t in plan.tasks}
        group_means = {
            g: mean([s.mean for t, s in counted.items() if groups[t] == g])
            for g in order_groups({groups[t] for t in counted})
        }
        row = ExperimentRow(
            experiment=name,
            runs=runs,
            scores=scores,
            task_mean=mean([s.mean for s in counted.values()]),
            group_means=group_means,
            trainable=math.nan,
            trainable_no_head=math.nan,
            published={t.key: _published_status(runs, t, published.get(name)) for t in tables},
            outside_tasks=tuple(t for t in scores if t not in counted),
        )
        # The cost figures read the runs the accuracy does (ExperimentRow.counted_runs): not another seed's or task's.
        row.trainable = mean([float(r.result.trainable_params) for r in row.counted_runs])
        row.trainable_no_head = mean([float(r.result.trainable_params_no_head) for r in row.counted_runs])
        rows.append(row)
    sized = sized_models(r.result for r in records)
    models = sorted({backbone(r.result, sized) for r in records})
    memory_kinds = sorted({str(r.result.peak_memory_kind) for r in records if r.result.peak_memory_kind})
    board = Leaderboard(
        Path(results_dir),
        tasks,
        groups,
        rows,
        models,
        tables,
        memory_kinds,
        dict(families),
        compute=compute,
        skipped=list(skipped),
        published_names=dict(published),
        plan=plan,
        sized=sized,
    )
    # Complete rows first: a mean over fewer tasks or seeds is not ranked among them.  Sorted into a new list, then
    # put back: complete() reads board.rows (the seed count most cells have, the ranked backbone), which CPython's
    # list.sort empties while it runs, so every row read as incomplete and a partial row's higher mean came first.
    rows[:] = sorted(
        rows,
        key=lambda r: (
            not board.complete(r),
            -ranking.score_key(r.task_mean) if not math.isnan(r.task_mean) else math.inf,  # equal means: by name
            r.experiment,
        ),
    )
    # What the board says of itself, each from the one before: saturated tasks are left out of the rank test, and
    # both decide columns.
    board.saturated = ranking.saturated_tasks(board)
    board.ranking = ranking.rank_test(board)
    board.columns = leaderboard_columns(board)
    for row in rows:
        row.values = {c.key: c.compute(row) for c in board.columns}
    return board


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
    """``leaderboard.csv``'s contents (text cells never start a formula; numbers are written as numbers)."""
    records = csv_records(board)
    columns = list(dict.fromkeys(k for rec in records for k in rec))
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([csv_cell(c) for c in columns])
    writer.writerows([[csv_cell(rec.get(c, "")) for c in columns] for rec in records])
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
        covered = [t for t in board.counted_tasks if table.covers(t)]  # as its means: not a task outside the suite
        labels = task_labels(covered)
        over = table.over_its_tasks(board.counted_tasks)  # beside the measured task mean: the suite's tasks
        headers = [
            Header("experiment", "petl experiment", "info"),
            Header("published_method", "Published row", "published"),
            *[Header(f"published:{t}", labels[t], "published") for t in covered],
            Header("published_task_mean", f"Task mean{over}", "published"),
            Header("published_group_mean", f"Group mean{over}", "published"),
            Header("published_params", "Params M", "published"),
            Header("published_ppt", f"PPT{over}", "published"),
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
                    *[show_number(pub.top1.get(table.column(t), math.nan), 1) for t in covered],
                    show_number(pub.task_mean),
                    show_number(table.group_mean(pub)),
                    show_number(pub.params / 1e6 if pub.params is not None else math.nan),
                    show_number(pub.ppt if pub.ppt is not None else math.nan),
                ]
            )
        if rows:
            title = f"Published per-task figures: {table.title} (not measured by petl)"
            out.append(Table(headers, rows, title, table.source))
    return out


def rank_table(board: Leaderboard) -> Table | None:
    """The rank test's table: each ranked experiment's mean rank, its interval and its groups (``None``: no test)."""
    found = board.ranking
    if not isinstance(found, ranking.Ranking):
        return None
    headers = [
        Header("experiment", "Experiment", "info"),
        Header("mean_rank", "Mean rank", "measured"),
        Header("mean_rank_interval", "95 % interval", "measured"),
        Header("rank_groups", "Groups", "info"),
        Header("task_mean", "Task mean", "measured"),
    ]
    means = {row.experiment: row.task_mean for row in board.rows}
    rows = []
    for name in found.methods:
        low, high = found.interval[name]
        rows.append(
            [
                (name, name),
                show_number(found.mean_rank[name]),
                (f"{low:.2f} – {high:.2f}", low) if not math.isnan(low) else ("–", ""),  # NaN: one block
                (found.letters(name), found.letters(name)),
                show_number(means[name]),
            ]
        )
    return Table(headers, rows, COMPARISON_TITLE)


def critical_difference_png(board: Leaderboard) -> bytes | None:
    """``critical_difference.png`` (:func:`petl.bench.ranking.critical_difference_png`); ``None`` without a test."""
    found = board.ranking
    if not isinstance(found, ranking.Ranking):
        return None
    title = f"Mean rank over {plural(len(found.blocks), found.block)} ({board.ranked_backbone}): a bar joins "
    title += f"methods {found.pair_test} cannot tell apart (α = {found.alpha:g})"
    return ranking.critical_difference_png(found, title)


def plan_of(suite_name: str, configs_dir: str | Path | None = None) -> Plan:
    """What suite ``suite_name`` sets out to run (its experiments, tasks and seeds), for :func:`aggregate`.

    Raises:
        ValueError: an unknown suite or a malformed suite file.

    """
    from petl.backbones.models import DEFAULT_MODEL
    from petl.bench import suite

    found = suite.load_suite(suite_name, suite.configs_dir(configs_dir))
    # The backbone the suite's file trains (petl's default where it names none): aggregate checks the runs against it.
    group = found.groups.get("model", {})
    model = str(group.get("name", DEFAULT_MODEL))
    return Plan(found.name, tuple(found.experiments), tuple(found.tasks), tuple(found.seeds), model, suite_size(group))


def check_plan_model(records: list[RunRecord], results_dir: str | Path, plan: Plan | None) -> None:
    """Refuse runs of another backbone than the one ``plan``'s suite trains (when the plan names one), or of another
    input resolution than its own (:func:`petl.bench.board.input_size`, when both are known).

    A board titled after a suite whose runs trained another backbone (``suite=mini_swin`` on a ViT's folder), or the
    suite's backbone at another size (``model.img_size=64`` on a 32-px suite), would read as that suite's.

    Raises:
        ValueError: one line naming the folder, the runs' backbones, the suite and its backbone; or the first run of
            another resolution (its ``result.json``), its size and the suite's.

    """
    if plan is None or plan.model is None:
        return
    others = sorted({str(r.result.model) for r in records} - {plan.model})
    if others:
        raise ValueError(
            f"{results_dir}: its runs trained {', '.join(others)}, and suite {plan.suite} trains {plan.model} (its "
            "model.name): name the suite these runs came from, or none"
        )
    if plan.img_size is None:
        return
    for record in sorted(records, key=lambda r: str(r.path)):
        size = input_size(record.result)
        if size is not None and size != plan.img_size:
            raise ValueError(
                f"{record.path}: this run trained {plan.model} at {size} px, and suite {plan.suite} trains it at "
                f"{plan.img_size} px (its model.img_size, else the model's own): name the suite these runs came "
                "from, or none"
            )


def _title(board: Leaderboard) -> str:
    if board.plan is not None:
        return f"petl leaderboard: suite {board.plan.suite}"
    # A folder named in bytes that are not UTF-8 (a Latin-1 "rés") shows its odd bytes as \xNN: the pages are UTF-8.
    return f"petl leaderboard: {shown(board.results_dir.name)}"


def _summary(board: Leaderboard) -> str:
    runs = sum(len(r.runs) for r in board.rows)
    return f"{plural(len(board.rows), 'experiment')}, {plural(len(board.tasks), 'task')}, {plural(runs, 'run')}."


def markdown(board: Leaderboard, legend: list[str] | None = None) -> str:
    """``leaderboard.md``: the main table, the details table, the legend, the comparison, the published tables.

    Args:
        board: the leaderboard.
        legend: its legend lines, when already built (:func:`petl.bench.notes.notes`, which warns of each damaged
            set-aside record: built once per report, each is named once); default: built here.
    """
    lines = [
        f"# {md_escape(_title(board))}",
        "",
        _summary(board),
        "",
        *markdown_lines(display_table(board)),
        "",
        f"## {DETAILS_TITLE}",
        "",
        *markdown_lines(details_table(board)),
        "",
        "## Legend",
        "",
        *[f"- {md_escape(n)}" for n in (notes(board) if legend is None else legend)],
        "",
        f"## {COMPARISON_TITLE}",
        "",
        *[f"- {md_escape(n)}" for n in comparison_lines(board)],
    ]
    table = rank_table(board)
    if table is not None:
        lines += ["", *markdown_lines(table), "", f"![critical-difference diagram]({CD_FILE})"]
    for table in published_tables(board):
        lines += ["", f"## {table.title}", "", f"Source: {table.source}.", "", *markdown_lines(table)]
    return "\n".join(lines) + "\n"


def _family_legend(board: Leaderboard) -> dict[str, str]:
    # Each family present -> what its methods train (empty for a family petl.presets.FAMILIES does not know).
    return {f: FAMILIES.get(f, "") for f in board.family_order}


def pareto_png(board: Leaderboard) -> bytes:
    """``pareto.png``: task-mean top-1 against trainable parameters, one marker and colour per method family."""
    from petl.bench.plot import Point, render_pareto  # matplotlib loads only when a plot is drawn

    # Accuracy at the rank test's precision (score_key): a larger row whose mean of the same hits, summed in another
    # order, is a bit above a smaller row's is as accurate, so not on the front.
    points = [
        Point(r.experiment, r.trainable, ranking.score_key(r.task_mean), board.complete(r), board.family(r))
        for r in board.rows
    ]
    return render_pareto(points, len(board.counted_tasks), board.models, _family_legend(board))


CURVES_FILE = "learning_curves.png"


def figures_drawn(out: str | Path) -> list[str]:
    """The figures a report wrote into ``out``: ``pareto.png``, then the curves and the rank test's diagram where drawn.

    :func:`write_report` removes a figure it does not draw (an earlier report's), so the folder says which it drew.
    """
    return ["pareto.png", *(name for name in (CURVES_FILE, CD_FILE) if (Path(out) / name).is_file())]


def learning_curves_png(board: Leaderboard) -> bytes | None:
    """``learning_curves.png``: val top-1 per epoch on one task, a panel per method family; ``None`` without curves."""
    found = learning_curves(board)
    if found is None:
        return None
    from petl.bench.plot import render_curves

    task, curves = found
    family_of = {row.experiment: board.family(row) for row in board.rows}
    return render_curves(curves, task, board.models, family_of, _family_legend(board), cut_curves(board, task))


def build_board(
    results_dir: str | Path,
    configs_dir: str | Path | None = None,
    plan: Plan | None = None,
) -> Leaderboard:
    """The leaderboard of ``results_dir``, built from its runs' result.json files (written nowhere).

    Args:
        results_dir: a results root holding ``<task>/<experiment>/seed<k>/result.json`` files.
        configs_dir: the folder of experiment files that name each experiment's published row and family
            (default: petl's own, see :func:`petl.bench.suite.configs_dir`).
        plan: what the suite the runs came from sets out to run (:func:`plan_of`); default: none, and a row
            counts as complete with every task of the board, each with as many seeds as most cells have or more
            (:attr:`petl.bench.board.Leaderboard.seed_count`).

    Raises:
        FileNotFoundError: ``results_dir`` is no folder, or holds no usable result.json.

    """
    results_dir = Path(results_dir)
    skipped: list[Path] = []
    results = read_all(results_dir, skipped)
    records = collect(results)
    if not records:
        if not results_dir.is_dir():
            said = "is a file" if results_dir.exists() else "does not exist"
            raise FileNotFoundError(f"{results_dir} {said}: give the folder a sweep or petl-run wrote its runs into")
        unusable = f" ({len(skipped)} skipped as damaged or incomplete, named above)" if skipped else ""
        raise FileNotFoundError(
            f"no usable result.json under {results_dir}{unusable}: give the folder a sweep or petl-run wrote its runs "
            "into (<task>/<experiment>/seed<k>/result.json)"
        )
    experiments = sorted({r.experiment for r in records})
    return aggregate(
        records,
        results_dir,
        published_names(experiments, configs_dir),
        family_names(experiments, configs_dir),
        plan,
        compute=compute_spent(results, results_dir),
        skipped=skipped,
    )


def check_not_in_run(path: Path, key: str) -> None:
    """Refuse a report or comparison written into a run folder (any run's: it, or a folder above, holds a run file).

    A run's files are replaced by a run, never by a page (as ``petl-predict`` and ``petl-export`` refuse too), even
    with ``overwrite=true``.

    Raises:
        ValueError: one line naming ``key=path``, the run folder and the run file it holds.

    """
    from petl.store.files import check_outside_runs

    said = f"{path}, where the report goes without out=," if key == "RESULTS_DIR" else f"{key}={path}"
    check_outside_runs(path, said, "a page")


def write_report(
    results_dir: str | Path,
    out_dir: str | Path | None = None,
    configs_dir: str | Path | None = None,
    plan: Plan | None = None,
) -> Leaderboard:
    """Build the leaderboard of ``results_dir`` (:func:`build_board`) and write md, csv, html and pareto.png.

    ``critical_difference.png`` (the rank test's diagram, :func:`critical_difference_png`) is written when the
    board has two complete rows to compare over two blocks.

    ``learning_curves.png`` (val top-1 per epoch on one task, :func:`learning_curves`) is written too
    when the runs recorded per-epoch val accuracy.  Either figure left in ``out_dir`` by an earlier report is removed
    when this board has none: it would show another board's rows beside this one's pages.

    Args:
        results_dir: a results root holding ``<task>/<experiment>/seed<k>/result.json`` files.
        out_dir: where to write (default: ``results_dir``).
        configs_dir: the folder of experiment files (see :func:`build_board`).
        plan: what the suite the runs came from sets out to run (see :func:`build_board`).

    Returns:
        The leaderboard.

    Raises:
        FileNotFoundError: no result.json under ``results_dir``.
        ValueError: the output folder is (inside) a run folder, or cannot be written (a file, read-only).

    """
    from petl.bench.html import Section, render_html
    from petl.utils.paths import cannot_write_in

    out = Path(out_dir) if out_dir is not None else Path(results_dir)
    check_not_in_run(out, "out" if out_dir is not None else "RESULTS_DIR")
    board = build_board(results_dir, configs_dir, plan)
    # Said before the plots are drawn, as bad input, rather than as an OSError on the first file written.
    unwritable = cannot_write_in(
        out, "choose another out=" if out_dir is not None else "write the report elsewhere with out=DIR"
    )
    if unwritable:
        raise ValueError(f"out={unwritable}" if out_dir is not None else unwritable)
    png = pareto_png(board)
    curves_png = learning_curves_png(board)
    figures = [("Accuracy against trainable parameters", png)]
    if curves_png is not None:
        figures.append(("Learning curves", curves_png))
    cd_png = critical_difference_png(board)
    legend = notes(board)
    html = render_html(
        _title(board),
        display_table(board),
        details_table(board),
        legend,
        figures,
        published_tables(board),
        _summary(board),
        Section(COMPARISON_TITLE, comparison_lines(board), rank_table(board), cd_png),
    )
    # Two sweeps finishing together both rebuild the report; each file is renamed into place whole.
    write_text(out / "leaderboard.csv", csv_text(board))
    write_text(out / "leaderboard.md", markdown(board, legend))
    write_atomic(out / "pareto.png", lambda tmp: tmp.write_bytes(png))
    write_text(out / "leaderboard.html", html)
    for name, drawn in ((CURVES_FILE, curves_png), (CD_FILE, cd_png)):
        if drawn is not None:
            write_atomic(out / name, lambda tmp, drawn=drawn: tmp.write_bytes(drawn))
        else:
            # An earlier report's figure of another board (more rows, a rank test) would sit beside this one's pages.
            (out / name).unlink(missing_ok=True)
    return board
