"""Two leaderboards' orderings side by side (``petl-bench compare``): one protocol on two backbones, say.

Each board is built from its runs (:func:`petl.bench.report.build_board`), never from a written leaderboard, and
only complete rows count: a row short of a task or seed has a mean over other tasks, which ranks nothing (and a row
on another backbone than the board's ranked one, :attr:`~petl.bench.board.Leaderboard.ranked_backbone`, is none).  An
experiment's rank is its place among its own board's complete rows; Spearman's rho is computed over the
experiments complete on both boards (their task means, :func:`petl.bench.published.rank_correlation`), with a
95 % bootstrap interval over those experiments (seeded: the same runs give the same page).  The places an experiment
moved are counted among those shared experiments alone: two boards of different sizes (a 27-row board against a
9-row one) would otherwise read every row of the smaller as moving up.  Rows of one task mean share their place, the
mean of the places they take (as Spearman's rho ranks ties): a tie broken by name would read as an order, and as places
moved.  The interval resamples the experiments in
name order, so ``compare A B`` and ``compare B A`` give the same page up to its sides.

Both boards must rank the same tasks (:func:`check_same_tasks`): a task mean over other tasks ranks the methods
on other data, and a rho between the two would read as agreement about one benchmark.  The page names the tasks.

Own images (``suite=choose data=folder``) are one task named after the dataset (``folder``) in every results
folder: two folders of different images would line up as one task.  Their ``data.json`` fingerprints
(:mod:`petl.bench.own_data`) must therefore agree, else the comparison is refused (:func:`check_same_data`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from petl.bench.board import Leaderboard
from petl.bench.published import MIN_RANKED, RankCorrelation, rank_correlation, rank_interval
from petl.bench.ranking import score_key
from petl.bench.table import md_escape
from petl.utils.text import plural


@dataclass(frozen=True)
class Placing:
    """Where one experiment stands on one board: its rank among the complete rows (1 = best) and task mean.

    Rows of one task mean share the mean of the places they take (two rows tied first are both 1.5).
    """

    rank: float
    task_mean: float


@dataclass(frozen=True)
class Comparison:
    """Two boards' complete rows, matched by experiment name.

    Attributes:
        labels: how each board is named in the output (its suite, else its folder).
        models: per board, the backbones its runs trained.
        tasks: the tasks both boards rank (:func:`check_same_tasks`), in the first board's order.
        complete: per board, experiment -> its :class:`Placing`, for every complete row.
        correlation: Spearman's rho over the experiments complete on both boards (in the second board's order).

    """

    labels: tuple[str, str]
    models: tuple[list[str], list[str]]
    tasks: tuple[str, ...]
    complete: tuple[dict[str, Placing], dict[str, Placing]]
    correlation: RankCorrelation

    @property
    def shared(self) -> tuple[str, ...]:
        """The experiments complete on both boards, best first on the second."""
        return self.correlation.methods

    def places_moved_up(self, experiment: str) -> float:
        """How many places ``experiment`` rose from the first board to the second, among the shared experiments.

        Ties share their mean place (:func:`tied_rank`), so a row that ties another moves half a place, not one.
        """
        first, second = ({e: places[e].task_mean for e in self.shared} for places in self.complete)
        return tied_rank(experiment, first) - tied_rank(experiment, second)


def tied_rank(name: str, means: dict[str, float]) -> float:
    """``name``'s place among ``means`` (1 = the highest), rows of one mean sharing the mean of their places."""
    above = sum(m > means[name] for m in means.values())
    tied = sum(m == means[name] for m in means.values())
    return above + (tied + 1) / 2


def check_same_data(first: str | Path, second: str | Path) -> None:
    """Refuse two results folders of own data whose images differ (their ``data.json`` fingerprints).

    Raises:
        ValueError: one line naming both folders and their data.

    """
    from petl.bench.own_data import SHORT, read_record

    records = [read_record(Path(folder)) for folder in (first, second)]
    if records == [None, None]:
        return  # registered tasks: the task name is the data's identity
    ids = [(r or {}).get("fingerprint") for r in records]
    if ids[0] != ids[1]:
        said = [
            f"{r['task']} {r['root']} (fingerprint {str(r.get('fingerprint'))[:SHORT]})" if r else "registered tasks"
            for r in records
        ]
        raise ValueError(
            f"{first} holds runs on {said[0]} and {second} on {said[1]}: different data, so one task's ranks would "
            "compare nothing; compare folders of the same images"
        )


def check_same_tasks(first: Leaderboard, second: Leaderboard) -> None:
    """Refuse two boards that rank different tasks (a suite's plan's, else the tasks their runs ran).

    The tasks the means count (:attr:`~petl.bench.board.Leaderboard.counted_tasks`): a run of a task outside a
    board's suite is in none of its means, so it does not make the boards rank different tasks.

    Raises:
        ValueError: one line naming both folders and their task lists.

    """
    a, b = first.counted_tasks, second.counted_tasks
    if set(a) != set(b):
        raise ValueError(
            f"{first.results_dir} ranks {plural(len(a), 'task')} ({', '.join(a)}) and "
            f"{second.results_dir} {plural(len(b), 'task')} ({', '.join(b)}): a task mean "
            "over other tasks ranks the methods on other data; compare folders of runs on the same tasks"
        )


def label(board: Leaderboard) -> str:
    """A board's name: ``suite NAME`` when it was built with a suite's plan, else its folder."""
    return f"suite {board.plan.suite}" if board.plan is not None else str(board.results_dir)


def placings(board: Leaderboard) -> dict[str, Placing]:
    """Experiment -> rank (ties share their mean place: :func:`tied_rank`) and task mean, for the complete rows.

    In the board's order, best first.
    """
    # At the rank test's precision (score_key): means of the same hits summed in another order are one place.
    means = {row.experiment: score_key(row.task_mean) for row in board.rows if board.complete(row)}
    return {name: Placing(tied_rank(name, means), mean) for name, mean in means.items()}


def compare(first: Leaderboard, second: Leaderboard) -> Comparison:
    """Match the complete rows of two boards by experiment and rank-correlate their task means.

    Raises:
        ValueError: the boards rank different tasks (:func:`check_same_tasks`).

    """
    check_same_tasks(first, second)
    a, b = placings(first), placings(second)
    correlation = rank_correlation({e: p.task_mean for e, p in b.items()}, {e: p.task_mean for e, p in a.items()})
    if not math.isnan(correlation.interval[0]):
        # rank_correlation resamples the experiments in the second board's order; in name order the interval is
        # the same whichever board comes first.
        names = sorted(correlation.methods)
        interval = rank_interval([b[e].task_mean for e in names], [a[e].task_mean for e in names])
        correlation = dataclasses.replace(correlation, interval=interval)
    labels, models = (label(first), label(second)), (first.models, second.models)
    return Comparison(labels, models, tuple(first.counted_tasks), (a, b), correlation)


def _not_computed(comparison: Comparison) -> str:
    """Why no coefficient: too few shared experiments, or one board ties them all."""
    shared = comparison.shared
    if len(shared) < MIN_RANKED:
        return f"not computed: {plural(len(shared), 'experiment')} complete on both; it needs {MIN_RANKED}."
    tied = [
        name
        for name, places in zip(comparison.labels, comparison.complete, strict=True)
        if len({places[e].task_mean for e in shared}) == 1
    ]
    return (
        f"not computed: the {len(shared)} experiments complete on both tie on {md_escape(' and on '.join(tied))} "
        "(one task mean), so that board ranks none above another."
    )


def markdown(comparison: Comparison) -> str:
    """The comparison as a Markdown page: the coefficient, then one line per shared experiment."""
    # Names come from folders and result.json files: escaped, so that none adds HTML or a table column (md_escape).
    (name_a, name_b), (a, b) = (md_escape(n) for n in comparison.labels), comparison.complete
    rho, shared = comparison.correlation.rho, comparison.shared
    if math.isnan(rho):
        verdict = _not_computed(comparison)
    else:
        verdict = (
            f"Spearman's rho = {comparison.correlation.describe()} over the {len(shared)} experiments complete on "
            "both boards."
        )
    lines = [
        f"# {name_a} against {name_b}",
        "",
        "Built from the runs by `petl-bench compare` (petl/bench/compare.py): each board's complete rows (every "
        "task, every seed) ranked by task mean; a rank is the place among that board's own complete rows, and the "
        "places moved are counted among the experiments complete on both.",
        "",
        *(
            f"- **{md_escape(name)}**: {plural(len(places), 'complete row')}; measured on "
            f"{md_escape(', '.join(models))}."
            for name, places, models in zip(comparison.labels, comparison.complete, comparison.models, strict=True)
        ),
        f"- **Tasks** (both boards): {md_escape(', '.join(comparison.tasks))}.",
        "",
        f"**Rank correlation of the task means**: {verdict}",
        "",
        f"| Experiment | Rank, {name_a} (of {len(a)}) | Task mean | Rank, {name_b} (of {len(b)}) | Task mean | "
        f"Places moved up (of the {len(shared)} compared) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for experiment in shared:
        first, second = a[experiment], b[experiment]
        lines.append(
            f"| {md_escape(experiment)} | {first.rank:g} | {first.task_mean:.2f} | {second.rank:g} | "
            f"{second.task_mean:.2f} | {comparison.places_moved_up(experiment):+g} |"
        )
    for name, own, other in ((name_a, a, b), (name_b, b, a)):
        alone = [e for e in own if e not in other]
        if alone:
            lines += ["", f"Complete only on {name} ({len(alone)}, not compared): {md_escape(', '.join(alone))}."]
    return "\n".join(lines) + "\n"
