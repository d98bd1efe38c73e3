"""Convergence: per-epoch val accuracy, from a run's own ``metrics.jsonl`` or its selected search trial's."""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from petl.bench.board import ExperimentRow, Leaderboard
from petl.bench.collect import RunRecord, nanmean
from petl.store.files import read_metrics
from petl.store.result import field_problem

# Convergence is judged on the last 20 % of epochs (issue 12): the val top-1 change over that stretch.
CONVERGENCE_TAIL = 0.2


@dataclass(frozen=True)
class ValCurve:
    """Val top-1 per epoch of one training run; ``source`` is the folder whose ``metrics.jsonl`` it came from.

    ``epochs`` holds each value's epoch, its metrics line's ``epoch`` (a skipped line leaves a gap, not a shift).
    """

    source: Path
    val_top1: tuple[float, ...]
    epochs: tuple[int, ...]


def _read_val_history(folder: Path) -> ValCurve | None:
    # A value that is no accuracy (text, NaN, infinity, outside 0-100: a hand edit, a damaged line) is skipped as a
    # line cut short is, rather than fail the report or flag a cell as still learning by +inf points; so is a line
    # whose epoch is no whole number from 1 (the curve is placed by it).  A line without one (a hand-made file; petl
    # writes it on every line) follows the line before it.  An epoch written twice keeps its last line.
    found: dict[int, float] = {}
    last = 0
    for row in read_metrics(folder):
        epoch, value = row.get("epoch", last + 1), row.get("val_top1")
        if not (isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 1):
            continue
        last = epoch
        if value is not None and field_problem("val_top1", value) is None:
            found[epoch] = float(value)
    epochs = sorted(found)
    return ValCurve(folder, tuple(found[e] for e in epochs), tuple(epochs)) if epochs else None


def val_curve(record: RunRecord) -> ValCurve | None:
    """The val accuracy per epoch behind one reported run, or ``None`` where none was recorded.

    A run on ``train800`` evaluated val itself, so its own ``metrics.jsonl`` is its curve.  A final run
    of the selection protocol trains on ``train800val200`` and has no val split; its curve is the one of
    the search trial it was chosen from (same configuration, one seed, on ``train800``), found through
    ``result["selection"]``: the chosen trial's ``output_dir`` ends in ``search/<point>`` under the
    experiment's folder.  One that leaves the results folder (``..``, an absolute path: an edited record) is not
    read: a warning names the file and the value.
    """
    own = _read_val_history(record.path.parent)
    if own is not None:
        return own
    selection = record.result.selection
    if not isinstance(selection, Mapping):
        return None
    for trial in selection.get("trials") or []:
        # A trial's folder that is no text (a hand edit; the reader checks only that trials are mappings) is none.
        folder = trial.get("output_dir")
        if trial.get("overrides") == selection.get("chosen") and isinstance(folder, str):
            parts = PurePosixPath(folder).parts
            if folder.startswith("/") or ".." in parts:
                # petl-bench writes it below the results folder: one leaving it (an edit) would show another folder's
                # curve as this run's.
                warnings.warn(
                    f"{record.path}: selection trial output_dir {folder!r} leaves the results folder: its curve is "
                    "not shown (restore the record petl-bench wrote)",
                    stacklevel=2,
                )
                return None
            return _read_val_history(record.path.parent.parent.joinpath(*parts[-2:]))
    return None


def tail_change(
    values: tuple[float, ...] | list[float],
    epochs: tuple[int, ...] | list[int] | None = None,
    tail: float = CONVERGENCE_TAIL,
) -> float:
    """Val top-1 change over the last ``tail`` of the epochs: last value minus the value ``k`` epochs earlier.

    ``k = max(1, round(tail * last epoch))``, counted in each value's epoch (``epochs``, its metrics line's; default
    1, 2, ...), not its position: where that epoch's line was skipped, the latest one before it is read (a longer
    stretch, never a shorter one).  NaN below two epochs.  Near zero for a converged run; 200 val images make one
    image 0.5 points.
    """
    if len(values) < 2:
        return math.nan
    epochs = list(epochs) if epochs is not None else list(range(1, len(values) + 1))
    k = min(epochs[-1] - epochs[0], max(1, round(tail * epochs[-1])))
    start = max(i for i, e in enumerate(epochs) if e <= epochs[-1] - k)
    return values[-1] - values[start]


def row_curves(row: ExperimentRow) -> dict[str, list[ValCurve]]:
    # The runs of the row's cells: with a suite, a run of a seed outside it is left out of the cell (TaskScore).
    return run_curves(row.counted_runs)


def run_curves(runs: list[RunRecord]) -> dict[str, list[ValCurve]]:
    # Per task, each distinct curve once: the seeds of one selected point share their search trial.
    out: dict[str, dict[Path, ValCurve]] = {}
    for run in sorted(runs, key=lambda r: (r.task, r.seed)):
        if (curve := val_curve(run)) is not None:
            out.setdefault(run.task, {}).setdefault(curve.source, curve)
    return {task: list(curves.values()) for task, curves in out.items()}


def convergence(row: ExperimentRow) -> tuple[float, float]:
    # (mean over tasks of the per-task mean change, largest |change| of any curve)
    changes = {t: [tail_change(c.val_top1, c.epochs) for c in cs] for t, cs in row_curves(row).items()}
    per_task = [nanmean(v) for v in changes.values()]
    every = [abs(v) for vs in changes.values() for v in vs if not math.isnan(v)]
    return nanmean(per_task), max(every, default=math.nan)


def learning_curves(board: Leaderboard, task: str | None = None) -> tuple[str, dict[str, dict[int, float]]] | None:
    """Val top-1 per epoch of every experiment on one task, averaged over that task's curves (seeds).

    Each value is placed at its metrics line's epoch, and a row's curve keeps only the epochs every one of its curves
    on the task has (:func:`cut_curves` names the rows that lose some), so that no epoch's mean is over fewer seeds.

    Args:
        board: the leaderboard.
        task: the task to show; default: the first task, in the leaderboard's order, with the most
            experiments that recorded a curve.

    Returns:
        ``(task, {experiment: {epoch: val top-1}})``, or ``None`` when no run recorded a val curve.

    """
    per_row = {row.experiment: row_curves(row) for row in board.rows}
    if task is None:
        counts = {t: sum(t in curves for curves in per_row.values()) for t in board.tasks}
        task = max(board.tasks, key=lambda t: counts[t], default=None)  # max keeps the first of equal counts
        if task is None or counts[task] == 0:
            return None
    out = {}
    for experiment, curves in per_row.items():
        if curves.get(task):
            shared = sorted(set.intersection(*(set(c.epochs) for c in curves[task])))
            if shared:
                out[experiment] = {e: statistics.fmean(_at(c, e) for c in curves[task]) for e in shared}
    return (task, out) if out else None


def cut_curves(board: Leaderboard, task: str) -> list[str]:
    """The experiments whose curves on ``task`` do not all have the same epochs, each with what its plotted curve
    keeps (``lora (3 of 5 epochs)``): :func:`learning_curves` averages only the epochs every curve has.
    """
    cut = []
    for row in board.rows:
        curves = row_curves(row).get(task) or []
        every = set().union(*(set(c.epochs) for c in curves))
        shared = set.intersection(*(set(c.epochs) for c in curves)) if curves else set()
        if shared != every:
            cut.append(f"{row.experiment} ({len(shared)} of {len(every)} epochs)")
    return cut


def _at(curve: ValCurve, epoch: int) -> float:
    return curve.val_top1[curve.epochs.index(epoch)]
