"""The leaderboard's data model: one row per experiment, its task scores, and the columns that render it.

:mod:`petl.bench.columns` declares the columns, :mod:`petl.bench.report` builds a board from results
and writes it.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petl.bench.collect import Compute, RunRecord, mean
from petl.bench.published import PublishedRow, PublishedTable
from petl.bench.table import Cell
from petl.data import GROUPS
from petl.presets import FAMILIES
from petl.store.result import RunResult

# What a published column shows for a row: the published row, or why there is none to show.
NO_PUBLISHED_ROW = "no published row"
DIFFERENT_BACKBONE = "different backbone"


def rounded(value: float | None, digits: int | None = 4) -> float | str:
    """A number as the CSV holds it: rounded to ``digits`` (``None``: as it is), empty where there is none (NaN)."""
    if value is None or math.isnan(value):
        return ""
    return value if digits is None else round(value, digits)


def show_number(value: float, digits: int = 2, suffix: str = "") -> Cell:
    if value is None or math.isnan(value):
        return "–", ""
    return f"{value:.{digits}f}{suffix}", value


def show_text(value: str) -> Cell:
    return value, value


def as_csv(key: str, digits: int | None = 4) -> Callable[[Any], dict[str, Any]]:
    # The default CSV writer of a column: one field named after the column, floats rounded (None: as
    # they are), NaN (nothing to show) written empty.
    def fields(value: Any) -> dict[str, Any]:
        return {key: rounded(value, digits) if isinstance(value, float) else value}

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
    show: Callable[[Any], Cell] = field(default=lambda value: show_number(value))
    csv: Callable[[Any], dict[str, Any]] | None = None
    kind: str = "measured"
    note: str = ""
    detail: bool = False

    def csv_fields(self, value: Any) -> dict[str, Any]:
        """The CSV fields of ``value``."""
        return (self.csv or as_csv(self.key))(value)


@dataclass(frozen=True)
class TaskScore:
    """Top-1 (%) of one experiment on one task over its seeds; ``std`` is NaN below two seeds.

    The mean keeps the seeds that did not learn (``not_learned``) and the seeds far from the others
    (``far_seeds``, :func:`petl.bench.ranking.far_seeds`): a cell never drops one of its seeds; it is marked.  Its
    seeds are the suite's when the board has a plan: a run of another seed is left out (``outside_seeds``), as a
    task outside the suite is left out of the means.
    """

    mean: float
    std: float
    seeds: tuple[int, ...]
    not_learned: tuple[int, ...] = ()  # the seeds whose training did not learn (petl.train.learning)
    far_seeds: tuple[int, ...] = ()
    tail_change: float = math.nan  # val top-1 change over the last epochs of the cell's curves (petl.bench.curves)
    outside_seeds: tuple[int, ...] = ()  # with a plan, the cell's runs of seeds outside it: left out of every figure


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
        outside_tasks: with a plan, the tasks of its runs outside the suite: each has its cell, and no part in the
            row's means or its cost figures (:attr:`counted_runs`).

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
    outside_tasks: tuple[str, ...] = ()

    @property
    def group_mean(self) -> float:
        """Mean of the group means (what VPT, NOAH and Adapter+ report)."""
        return mean(list(self.group_means.values()))

    @property
    def counted_runs(self) -> list[RunRecord]:
        """The runs the row's figures read: those of its cells' seeds, on the tasks its means count.

        With a suite, a run of a seed outside it is left out of its cell (``TaskScore.outside_seeds``) and a run of
        a task outside it out of the means (:attr:`outside_tasks`), so of the cost columns (parameters, train
        seconds, memory) too, which then read the runs the accuracy does.
        """
        return [
            r
            for r in self.runs
            if r.task in self.scores and r.task not in self.outside_tasks and r.seed in self.scores[r.task].seeds
        ]


@dataclass(frozen=True)
class Plan:
    """What a suite sets out to run: the leaderboard it will be once every final run has finished.

    Attributes:
        suite: the suite's name.
        experiments: its experiments (one row each once they have run).
        tasks: its tasks (one column each, shown "–" until a run of it finishes).
        seeds: the seeds of its reported runs (a cell is complete with all of them).
        model: the backbone its file trains (``model.name``), when the runs must be checked against it (a report
            asked about a suite by name); ``None``: not checked (a sweep's own report, whose command line may
            change the backbone).
        img_size: the input resolution its file trains at (:func:`suite_size`), checked as ``model`` is; ``None``:
            not checked.

    """

    suite: str
    experiments: tuple[str, ...]
    tasks: tuple[str, ...]
    seeds: tuple[int, ...]
    model: str | None = None
    img_size: int | None = None


@dataclass
class Leaderboard:
    """Everything a report renders: the tasks and groups found, one row per experiment, and the columns.

    ``saturated`` names the tasks every complete row has saturated (not ranked), ``ranking`` is the rank test of
    the complete rows (:func:`petl.bench.ranking.rank_test`: a ``Ranking``, or the reason none was run), all of them
    on one backbone (:attr:`ranked_backbone`).
    ``families`` maps an experiment to its method family (experiments without one are left out; they
    count as a family of their own, named after their method: :meth:`family`); ``published_names`` to the
    published row it stands for (``published:`` in its experiment file).  ``plan``, when the report was
    asked about a suite, is what that suite sets out to run: rows and cells are complete against it.
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
    skipped: list[Path] = field(default_factory=list)
    published_names: dict[str, str] = field(default_factory=dict)
    plan: Plan | None = None
    saturated: list[str] = field(default_factory=list)
    ranking: Any = None  # petl.bench.ranking.Ranking, or why no test ran
    sized: frozenset[str] = frozenset()  # the models run at more than one resolution (sized_models)
    # ranked_backbone, and the rows it was found from (their ids: found again if the rows change).
    _ranked: tuple[frozenset[int], str | None] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def family_order(self) -> list[str]:
        """Families present, in :data:`petl.presets.FAMILIES` order, then any other alphabetically."""
        known = list(FAMILIES)
        present = {self.family(row) for row in self.rows}
        return sorted(present, key=lambda f: (known.index(f) if f in known else len(known), f))

    def family(self, row: ExperimentRow) -> str:
        """The family of ``row``'s experiment; without one, the method its runs ran (a family of its own)."""
        return self.families.get(row.experiment) or ", ".join(dict.fromkeys(str(r.result.method) for r in row.runs))

    @property
    def counted_tasks(self) -> list[str]:
        """The tasks the means and the rank test cover: with a plan, its tasks, else every task of the board.

        A run of a task outside the plan (in the suite's folder) has a column, and no part in a row's means.
        """
        return [t for t in self.tasks if self.plan is None or t in self.plan.tasks]

    @property
    def group_names(self) -> list[str]:
        """Groups present, in benchmark order."""
        return order_groups(set(self.groups.values()))

    def backbones(self, row: ExperimentRow) -> dict[str, list[str]]:
        """The backbones ``row``'s counted runs trained (:func:`backbone`), each with the tasks it ran, in task order.

        The runs its figures read (:attr:`ExperimentRow.counted_runs`): a run of a seed or task outside the suite, in
        no mean, does not make the row's task mean one of several models.
        """
        found: dict[str, list[str]] = {}
        counted = row.counted_runs
        for task in self.tasks:
            for name in dict.fromkeys(backbone(r.result, self.sized) for r in counted if r.task == task):
                found.setdefault(name, []).append(task)
        return found

    def mixed(self, row: ExperimentRow) -> bool:
        """Whether ``row``'s tasks ran on more than one backbone (its task mean averages different models)."""
        return len(self.backbones(row)) > 1

    @property
    def ranked_backbone(self) -> str | None:
        """The one backbone whose rows are ranked: the one the most rows with every task and seed ran (a tie goes to
        the first by name); ``None`` without such a row.

        A folder may hold two suites' runs, or an experiment rerun with ``model=`` another: ranked together, its rows
        would compare backbones as much as methods.  The majority keeps what most of the board ran; the name makes a
        tie give the same board every time.
        """
        # Asked once a row (complete(), the table's marks, the legend) and found from every row: kept, or a board of
        # 30 experiments on 7 tasks spent half its build finding it again.
        rows = frozenset(map(id, self.rows))
        if self._ranked is None or self._ranked[0] != rows:
            seeds = self.seed_count  # once, not once a row: it reads every cell of the board
            found = Counter(next(iter(self.backbones(row))) for row in self.rows if self._every_cell(row, seeds))
            self._ranked = (rows, min(found, key=lambda name: (-found[name], name)) if found else None)
        return self._ranked[1]

    def other_backbone(self, row: ExperimentRow) -> bool:
        """Whether ``row``'s tasks all ran on one backbone, not the :attr:`ranked_backbone`."""
        found = self.backbones(row)
        return len(found) == 1 and self.ranked_backbone not in (None, *found)

    @property
    def seed_count(self) -> int:
        """The seeds a complete cell has: the plan's; without one, as many as most cells of the board have (of two
        counts as common, the larger), so that one extra seed in one cell leaves the other rows complete.
        """
        if self.plan is not None:
            return len(self.plan.seeds)
        found = Counter(len(s.seeds) for r in self.rows for s in r.scores.values())
        return max(found, key=lambda n: (found[n], n), default=0)

    def more_seeds(self, score: TaskScore) -> bool:
        """Whether a cell ran more seeds than :attr:`seed_count`: without a plan, its figures are over all of them;
        with one, the other seeds' runs are left out (``outside_seeds``).  Either way the cell is marked.
        """
        return bool(score.outside_seeds) or (self.plan is None and len(score.seeds) > self.seed_count)

    def outside_seeds(self, row: ExperimentRow, task: str) -> list[int]:
        """With a plan, the seeds outside it of ``row``'s runs of ``task``; a cell of only such runs has no score,
        and is marked all the same.
        """
        if self.plan is None:
            return []
        return sorted({r.seed for r in row.runs if r.task == task and r.seed not in self.plan.seeds})

    def complete(self, row: ExperimentRow) -> bool:
        """Whether ``row`` has a score on every task, each over every seed, all on the board's one backbone.

        Every task and seed: the plan's, when there is one (and a row of an experiment outside the plan is never
        complete: the suite does not rank it); otherwise every task of the board, each with at least
        :attr:`seed_count` seeds (the count most cells have).  A row whose tasks ran on different backbones
        (:meth:`mixed`) is never complete: its task mean is no one model's; nor is a row on another backbone than
        the :attr:`ranked_backbone` (:meth:`other_backbone`).
        """
        return self._every_cell(row, self.seed_count) and not self.other_backbone(row)

    def _every_cell(self, row: ExperimentRow, seeds: int) -> bool:
        # complete() less the board's backbone, which is decided from the rows this passes; seeds: seed_count.
        if self.mixed(row):
            return False
        if self.plan is not None:
            planned = set(self.plan.seeds)
            return row.experiment in self.plan.experiments and all(
                t in row.scores and planned <= set(row.scores[t].seeds) for t in self.plan.tasks
            )
        return all(t in row.scores and len(row.scores[t].seeds) >= seeds for t in self.tasks)


def configured_size(model: Any) -> int | None:
    """The input resolution a ``model`` config group sets; ``None``: it sets none (the model's own is used).

    Set as ``model.img_size``, as ``model.kwargs.img_size`` (the same timm argument, petl.train.readers.model_kwargs),
    or, for a NaFlexVit, as ``model.kwargs.pretrained_cfg_overlay.input_size`` (``[3, N, N]``).
    """
    if not isinstance(model, dict):
        return None
    kwargs = model.get("kwargs") if isinstance(model.get("kwargs"), dict) else {}
    overlay = kwargs.get("pretrained_cfg_overlay") if isinstance(kwargs.get("pretrained_cfg_overlay"), dict) else {}
    shape = overlay.get("input_size")
    for size in (
        model.get("img_size"),
        kwargs.get("img_size"),
        shape[-1] if isinstance(shape, list) and shape else None,
    ):
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None


@functools.cache
def own_input_size(model: str) -> int | None:
    """The input resolution timm builds ``model`` at when none is given: its pretrained config's ``input_size``.

    ``None`` where timm knows no pretrained config of that name (a model registered by a plugin not imported here).
    """
    import timm.models

    import petl.backbones  # noqa: F401  (registers petl's own models, whose sizes timm then knows)

    try:
        found = timm.models.get_pretrained_cfg(model)
    except (RuntimeError, ValueError):  # a name timm cannot parse: no size known
        return None
    size = getattr(found, "input_size", None)
    return int(size[-1]) if size else None


def suite_size(model: Any) -> int | None:
    """The input resolution a suite's ``model`` group trains at: the one it sets, else its model's own (petl's default
    model where it names none); ``None`` where neither is known.
    """
    from petl.backbones.models import DEFAULT_MODEL

    size = configured_size(model)
    name = model.get("name", DEFAULT_MODEL) if isinstance(model, dict) else DEFAULT_MODEL
    return size if size is not None else own_input_size(str(name))


def input_size(result: RunResult) -> int | None:
    """The input resolution a run trained at: the one its config sets (:func:`configured_size`), else its model's own
    (:func:`own_input_size`); ``None`` where neither is known, and for a record without the run's ``model`` config
    (what it set is not known).

    Resolved to a number so that ``model.img_size=224`` on a model built at 224 px and no ``model.img_size`` are one
    backbone, not two.
    """
    model = result.config.get("model") if isinstance(result.config, dict) else None
    if not isinstance(model, dict):
        return None
    size = configured_size(model)
    if size is not None:
        return size
    return own_input_size(str(result.model)) if result.model else None


def sized_models(results: Iterable[RunResult]) -> frozenset[str]:
    """The models ``results`` ran at more than one input resolution (:func:`input_size`)."""
    sizes: dict[str, set[int | None]] = {}
    for result in results:
        sizes.setdefault(str(result.model or "?"), set()).add(input_size(result))
    return frozenset(name for name, found in sizes.items() if len(found) > 1)


def backbone(result: RunResult, sized: frozenset[str] = frozenset()) -> str:
    """The backbone a run trained, as boards name it: its timm name, and where its weights came from when they are
    not the pretrained ones (a local file, or a random init: a different model from its pretrained namesake).

    ``sized``: the models the board ran at more than one resolution (:func:`sized_models`), whose runs are named with
    theirs: a model at 64 px is not the model at 32 px, and rows of the two ranked together would compare resolutions.
    A run at its model's own size is named with that size (``vit_base_patch16_224 at 224 px``), as is one given it
    explicitly; "at its own resolution" only where timm knows no size of the model.
    """
    name = str(result.model or "?")
    if name in sized:
        size = input_size(result)
        name += f" at {size} px" if size is not None else " at its own resolution"
    if result.pretrained is not False:
        return name
    return f"{name} (weights from {result.checkpoint})" if result.checkpoint else f"{name} (random init)"


def order_groups(groups: set[str]) -> list[str]:
    """Task groups in :data:`petl.data.GROUPS`' order; unknown groups follow alphabetically."""
    return sorted(groups, key=lambda g: (GROUPS.index(g) if g in GROUPS else len(GROUPS), g))
