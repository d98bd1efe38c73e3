"""Every leaderboard column, declared once: label, value, display, CSV fields and legend.

Adding a column = adding one :class:`Column` to :func:`leaderboard_columns`; the CSV, Markdown and
HTML writers only iterate the declarations.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from petl.bench.board import (
    Column,
    ExperimentRow,
    Leaderboard,
    TaskScore,
    as_csv,
    rounded,
    show_number,
    show_text,
)
from petl.bench.collect import describe_run, format_option, mean, nanmax, nanmean, number
from petl.bench.curves import CONVERGENCE_TAIL, convergence
from petl.bench.published import PublishedRow, PublishedTable, ppt
from petl.bench.ranking import RISING_POINTS, Ranking, score_key
from petl.bench.table import Cell, md_name
from petl.presets import FAMILIES


def _show_convergence(value: tuple[float, float]) -> Cell:
    mean, worst = value
    if math.isnan(mean):
        return "–", ""
    return f"{mean:+.2f} (max {worst:.2f})", mean


# The cell marks, each one rule (petl.bench.ranking): a seed far from the others, still learning at its last epochs.
FAR_SEED_MARK = "‡"
RISING_MARK = "↑"
SATURATED_MARK = "(saturated)"
NOT_IN_SUITE_MARK = "(not in the suite)"
MORE_SEEDS_MARK = "⁺"  # more seeds than most cells (Leaderboard.more_seeds)


def _outside(board: Leaderboard, task: str) -> str:
    # A task the board's suite does not run: its column is shown, its cells in no mean (Leaderboard.counted_tasks).
    return f" {NOT_IN_SUITE_MARK}" if task not in board.counted_tasks else ""


def still_learning(score: TaskScore) -> bool:
    """Whether the cell's val curve still rose by :data:`petl.bench.ranking.RISING_POINTS` at its last epochs."""
    # At score_key's precision: 3 of 30 val images more is 100 * 7 / 30 - 100 * 4 / 30 = 9.999999999999998 points.
    return score_key(score.tail_change) >= RISING_POINTS


def _score_cell(score: TaskScore | None, more_seeds: bool = False) -> Cell:
    if score is None:
        return ("– " + MORE_SEEDS_MARK if more_seeds else "–"), ""
    mean, std = show_number(score.mean), show_number(score.std)
    text = mean[0] if math.isnan(score.std) else f"{mean[0]} ± {std[0]}"
    marks = [f"†{len(score.not_learned)}"] if score.not_learned else []
    marks += [FAR_SEED_MARK] if score.far_seeds else []
    marks += [RISING_MARK] if still_learning(score) else []
    marks += [MORE_SEEDS_MARK] if more_seeds else []
    return " ".join([text, *marks]), score.mean


def _task_value(board: Leaderboard, row: ExperimentRow, task: str) -> tuple[TaskScore | None, bool]:
    # A task cell's score and whether it is marked ⁺: with a suite, a cell whose runs are all of seeds outside it has
    # no score and is marked all the same, as the legend names it.
    score = row.scores.get(task)
    return score, board.more_seeds(score) if score is not None else bool(board.outside_seeds(row, task))


def _task_csv(board: Leaderboard, task: str, score: TaskScore | None) -> dict[str, Any]:
    t = task
    return {
        f"{t}_top1_mean": rounded(score.mean) if score else "",
        f"{t}_top1_std": rounded(score.std) if score else "",
        f"{t}_seeds": " ".join(map(str, score.seeds)) if score else "",
        f"{t}_not_learned_seeds": " ".join(map(str, score.not_learned)) if score else "",
        f"{t}_far_seeds": " ".join(map(str, score.far_seeds)) if score else "",
        f"{t}_val_tail_change": rounded(score.tail_change) if score else "",
        f"{t}_saturated": int(t in board.saturated),
    }


def _ranked(board: Leaderboard, key: str) -> Callable[[ExperimentRow], Any]:
    # A figure of the rank test for one row: its mean rank, interval ends or group letters; empty when unranked.
    def value(row: ExperimentRow) -> Any:
        found = board.ranking
        if not isinstance(found, Ranking) or row.experiment not in found.mean_rank:
            return math.nan if key != "groups" else ""
        if key == "groups":
            return found.letters(row.experiment)
        low, high = found.interval[row.experiment]
        return {"mean_rank": found.mean_rank[row.experiment], "low": low, "high": high}[key]

    return value


def task_labels(tasks: list[str]) -> dict[str, str]:
    # Short names keep 19 columns readable; the full name stays when two families share a short name.
    short = {t: t.rsplit("/", 1)[-1] for t in tasks}
    counts = {s: list(short.values()).count(s) for s in short.values()}
    return {t: (s if counts[s] == 1 else t) for t, s in short.items()}


def _count_with_pct(total_key: str) -> Callable[[ExperimentRow], tuple[float, float]]:
    # (mean count, mean share of all parameters in %) of a result.json count field.
    def compute(row: ExperimentRow) -> tuple[float, float]:
        counts = [float(getattr(r.result, total_key)) for r in row.counted_runs]
        totals = [float(r.result.total_params) for r in row.counted_runs]
        return mean(counts), mean([100 * p / t for p, t in zip(counts, totals, strict=True)])

    return compute


def _show_count(value: tuple[float, float]) -> Cell:
    if math.isnan(value[0]):  # no run counted: a row whose runs are all outside its suite's seeds or tasks
        return show_number(value[0])
    return f"{value[0] / 1e6:.4f} ({value[1]:.2f}%)", value[0]


def _selection(row: ExperimentRow, labels: dict[str, str]) -> str:
    # result.json's "selection" record (written by a search-then-final sweep): the configuration chosen on val.
    chosen: dict[str, list[str]] = {}
    for run in row.runs:
        selection = run.result.selection
        if isinstance(selection, Mapping) and selection.get("chosen") is not None:
            # An empty choice: the experiment pins every searched key (a `pinned_trial` suite's one trial), or
            # a search whose only point is the defaults.
            text = format_option(selection["chosen"]) or ("pinned" if not selection.get("space") else "defaults")
            if text not in chosen.setdefault(run.task, []):
                chosen[run.task].append(text)
    return "; ".join(f"{labels.get(t, t)}: {' | '.join(v)}" for t, v in chosen.items())


def _published_columns(board: Leaderboard, table: PublishedTable) -> list[Column]:
    """One published table's columns: its row name (or why none), per-task figures (CSV), summaries, source."""
    prefix = f"published_{table.key}"
    # Its means are over all its tasks, whichever this board's means cover (a suite's: not a task outside it).
    over = table.over_its_tasks(board.counted_tasks)

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

    columns = [
        Column(f"{prefix}_method", f"Published {table.key} row", status, show_text, kind="published", detail=True)
    ]
    columns += [
        Column(
            f"{prefix}_{column}",
            None,
            of(lambda pub, column=column: pub.top1.get(column, math.nan)),
            csv=as_csv(f"{prefix}_{column}", None),
        )
        for column in [table.column(t) for t in board.counted_tasks if table.covers(t)]
    ]
    columns += [
        Column(
            f"{prefix}_task_mean",
            f"Published {table.key} task mean{over}",
            of(lambda pub: pub.task_mean),
            kind="published",
            detail=True,
        ),
        Column(
            f"{prefix}_group_mean",
            f"Published {table.key} group mean{over}",
            of(table.group_mean),
            csv=as_csv(f"{prefix}_group_mean", 2),
            kind="published",
            detail=True,
        ),
        Column(
            f"{prefix}_params",
            f"Published {table.key} params M",
            of(million),
            csv=as_csv(f"{prefix}_params_M", 4),
            kind="published",
            detail=True,
        ),
        Column(
            f"{prefix}_ppt",
            f"Published {table.key} PPT{over}",
            of(lambda pub: pub.ppt if pub.ppt is not None else math.nan),
            kind="published",
            detail=True,
        ),
        Column(f"{prefix}_source", None, lambda row: table.source),
    ]
    return columns


def _devices(row: ExperimentRow) -> str:
    # "cpu", or "cpu 9, cuda 12" when the reported runs of one row trained on different devices.
    counts = Counter(str(r.result.device or "?") for r in row.counted_runs)
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
        lambda row: reduce([number(r, key) for r in row.counted_runs]),
        lambda v: show_number(v, shown_digits),
        csv=as_csv(key, csv_digits),
        detail=True,
    )


def leaderboard_columns(board: Leaderboard) -> list[Column]:
    """Every column of the leaderboard, in display and CSV order (measured first, then published tables).

    The main table (columns without ``detail``) reads left to right as: experiment, parameters, the means,
    the per-task accuracies; the details table holds configuration, selection, convergence, cost and the
    published figures.
    """
    labels = task_labels(board.tasks)
    counted = board.counted_tasks
    several_groups = len(board.group_names) > 1
    any_selection = any(r.result.selection is not None for row in board.rows for r in row.runs)
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
        Column("method", None, lambda row: ", ".join(dict.fromkeys(str(r.result.method) for r in row.runs))),
        Column(
            "family",
            "Family",
            board.family,
            show_text,
            kind="info",
            note="**Family**: the kind of method, from the experiment file's `family:` ("
            + "; ".join(f"{f}: {FAMILIES[f]}" if f in FAMILIES else md_name(f) for f in board.family_order)
            + "). The plots give each family one marker and colour, and one panel of learning curves.",
            detail=True,
        ),
        Column("runs", None, lambda row: len(row.runs)),
        # Of the tasks the means count: with a suite, a run of a task outside it makes no row more done.
        Column("tasks_done", None, lambda row: f"{sum(t in row.scores for t in counted)}/{len(counted)}"),
        Column(
            "trainable",
            "Trainable M (%)",
            _count_with_pct("trainable_params"),
            _show_count,
            csv=lambda v: {"trainable_M": rounded(v[0] / 1e6, 6), "trainable_pct": rounded(v[1])},
        ),
        Column(
            "trainable_no_head",
            "Trainable w/o head M (%)",
            _count_with_pct("trainable_params_no_head"),
            _show_count,
            csv=lambda v: {"trainable_no_head_M": rounded(v[0] / 1e6, 6), "trainable_no_head_pct": rounded(v[1])},
            detail=True,
        ),
        Column("task_mean", "Task mean", lambda row: row.task_mean),
    ]
    columns += [
        Column(
            f"group:{g}",
            f"{g.capitalize()} mean" if several_groups else None,
            lambda row, g=g: row.group_means.get(g, math.nan),
            csv=as_csv(f"group_mean_{g}"),
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
            f"{labels[t]} {SATURATED_MARK}" if t in board.saturated else f"{labels[t]}{_outside(board, t)}",
            lambda row, t=t: _task_value(board, row, t),
            lambda value: _score_cell(*value),
            csv=lambda value, t=t: _task_csv(board, t, value[0]),
        )
        for t in board.tasks
    ]

    # The rank test's figures for the CSV (the Markdown and HTML pages give them a section of their own).
    columns += [
        Column("mean_rank", None, _ranked(board, "mean_rank")),
        Column("mean_rank_low", None, _ranked(board, "low")),
        Column("mean_rank_high", None, _ranked(board, "high")),
        Column("rank_groups", None, _ranked(board, "groups")),
    ]
    columns.append(
        Column(
            "val_tail_change",
            f"Val Δ last {CONVERGENCE_TAIL:.0%} ep",
            convergence,
            _show_convergence,
            csv=lambda v: {
                f"val_change_last{tail_pct}_mean": rounded(v[0]),
                f"val_change_last{tail_pct}_max_abs": rounded(v[1]),
            },
            note=f"**Val Δ last {CONVERGENCE_TAIL:.0%} ep**: convergence check, the val top-1 change (points) over "
            f"the last {CONVERGENCE_TAIL:.0%} of the epochs, mean over tasks (in brackets the largest absolute change "
            "of any one curve, the figure to read: opposite changes on two tasks cancel in the mean): from each "
            "run's own per-epoch val accuracy (metrics.jsonl), or, for a final run trained on train+val, from the "
            "search trial it was selected from (one seed); – where none was recorded.",
            detail=True,
        )
    )
    if any(r.result.device for row in board.rows for r in row.runs):
        columns.append(
            Column(
                "device",
                "Device",
                _devices,
                show_text,
                kind="info",
                note="**Device**: where the reported runs trained (result.json's `device`; with several, how many "
                "runs each). Train s/run, Images/s and Peak MB compare only between rows on the same device.",
                detail=True,
            )
        )
    columns += [
        _result_column("train_seconds", "Train s/run", nanmean, 1, 2),
        _result_column("images_per_second", "Images/s", nanmean, 0, 1),
        _result_column("peak_memory_mb", "Peak MB", nanmax, 0, 1),
    ]
    for table in board.tables:
        columns += _published_columns(board, table)
    # Long texts last, where they can wrap without pushing a number off the screen.
    columns.append(
        Column(
            "config",
            "petl config",
            lambda row: " | ".join(dict.fromkeys(describe_run(r) for r in row.runs)),
            show_text,
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
                show_text,
                kind="info",
                note="**Selected on val**: per task, the configuration the search chose on the validation split "
                "(result.json's `selection` record); the task's scores are of that configuration's final runs.",
                detail=True,
            )
        )
    return columns
