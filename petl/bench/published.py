"""Figures other people published, kept apart from anything petl measures.

The CSVs in ``petl/bench/published/`` are copies of the V-PETL Bench tables (ViT-B/16 pretrained on
ImageNet-21k).  They ship inside the package because users have no copy of the project's shared
folder.  Leaderboards show them only in columns labelled "published", with :attr:`PublishedTable.source`
beside them, and only beside runs on the table's own backbone (:attr:`PublishedTable.backbone`); which
experiment matches which row is written in the experiment files (``published:``).  ``petl-bench params``
checks petl's parameter counts against the rows' (:meth:`PublishedRow.params_match`).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from petl.data import get_info

PUBLISHED_DIR = Path(__file__).parent / "published"

# The denominator C of V-PETL's Performance-Parameter Trade-off.
PPT_SCALE = 1e7

# The backbone V-PETL's tables were measured on: Google's ViT-B/16 pretrained on ImageNet-21k
# (V-PETL scripts load released_models/ViT-B_16.npz), timm's `orig_in21k` tag of it.
PUBLISHED_BACKBONE = "vit_base_patch16_224.orig_in21k"

# Which petl experiment stands for which published row is written in each experiment file
# (`published:`), so that a new method's file carries its own mapping.

_SOURCE = (
    "V-PETL Bench README (github.com/synbol/Parameter-Efficient-Transfer-Learning-Benchmark, commit c188fad), "
    "ViT-B/16 pretrained on ImageNet-21k"
)


def ppt(mean_top1_percent: float, trainable_params: float) -> float:
    """V-PETL's Performance-Parameter Trade-off: ``M * exp(-log10(P / C + 1))``.

    Args:
        mean_top1_percent: mean top-1 accuracy in percent (converted to the fraction M here).
        trainable_params: P, the trained parameters outside the classifier head (V-PETL counts
            linear probing as 0M, so heads are excluded).

    Returns:
        The PPT score (NaN when the accuracy is NaN).

    """
    return (mean_top1_percent / 100.0) * math.exp(-math.log10(trainable_params / PPT_SCALE + 1.0))


def parse_params(text: str) -> float | None:
    """Parse a published parameter count such as ``0.29M`` or ``0 M`` into a number of parameters."""
    text = text.strip().replace(" ", "")
    if not text or text == "-":
        return None
    if text[-1] in "Mm":
        return float(text[:-1]) * 1e6
    return float(text)


def params_digits(text: str) -> int:
    """Decimals of a published count in millions (``0.29M`` -> 2, ``85.8M`` -> 1, ``0 M`` -> 0)."""
    number = text.strip().replace(" ", "").rstrip("Mm")
    return len(number.partition(".")[2])


@dataclass(frozen=True)
class PublishedRow:
    """One published method: per-task top-1 (%), the table's own task mean, params and PPT.

    ``params_digits`` is the precision the count was published at (decimals in millions), the
    precision ``petl-bench params`` compares petl's own count at.
    """

    method: str
    top1: dict[str, float]
    task_mean: float
    params: float | None
    ppt: float | None
    params_digits: int = 2

    def params_match(self, count: float) -> bool:
        """Whether ``count`` parameters round to the published figure at its published precision."""
        if self.params is None:
            return False
        return round(count / 1e6, self.params_digits) == round(self.params / 1e6, self.params_digits)


@dataclass(frozen=True)
class PublishedTable:
    """A published results table and how petl task names map onto its columns.

    Attributes:
        key: short name used in column labels (``vtab1k``, ``fgvc``).
        prefix: petl dataset prefix the table covers (``vtab/`` covers ``vtab/cifar100``...).
        filename: the CSV under ``petl/bench/published/``.
        title: human-readable table name.
        source: where the figures come from (printed beside every published column).
        backbone: the timm name of the backbone the figures were measured on; a run on another
            backbone is not shown beside them.
        img_size: the input resolution the figures were measured at; a run at another (``model.img_size``) is not
            shown beside them.

    """

    key: str
    prefix: str
    filename: str
    title: str
    source: str
    backbone: str = PUBLISHED_BACKBONE
    img_size: int = 224

    def covers(self, task: str) -> bool:
        """Whether petl dataset ``task`` is one of this table's columns."""
        return task.startswith(self.prefix)

    def column(self, task: str) -> str:
        """The table's column name for petl dataset ``task`` (the name after the prefix)."""
        return task[len(self.prefix) :]

    def rows(self) -> dict[str, PublishedRow]:
        """The table's rows by method name."""
        return _load(PUBLISHED_DIR / self.filename)

    def columns(self) -> list[str]:
        """The table's task columns, in published order (the names after the prefix)."""
        return list(next(iter(self.rows().values())).top1)

    def over_its_tasks(self, tasks: Sequence[str]) -> str:
        """`` (its 19 tasks)`` where ``tasks`` (petl dataset names) leave out some of the table's columns, else ``""``.

        The table's task mean, group mean and PPT are over all its columns: beside a board of fewer of them, a
        label without the count reads as the mean over the board's tasks, which it is not.
        """
        ran = {self.column(t) for t in tasks if self.covers(t)}
        missing = set(self.columns()) - ran
        return f" (its {len(self.columns())} tasks)" if missing else ""

    def group_of(self, column: str) -> str:
        """The benchmark group of a column (VTAB's three groups; one group for FGVC), from petl's dataset registry."""
        return get_info(self.prefix + column).group

    def group_mean(self, row: PublishedRow) -> float:
        """Mean of the group averages of ``row``'s per-task figures."""
        by_group: dict[str, list[float]] = {}
        for column, value in row.top1.items():
            by_group.setdefault(self.group_of(column), []).append(value)
        return sum(sum(v) / len(v) for v in by_group.values()) / len(by_group)


TABLES = (
    PublishedTable(
        "vtab1k",
        "vtab/",
        "vtab1k_vitb16_in21k_vpetl.csv",
        'VTAB-1k, table "Benchmark results of image classification on VTAB"',
        _SOURCE,
    ),
    PublishedTable("fgvc", "fgvc/", "fgvc_vitb16_in21k_vpetl.csv", "FGVC", _SOURCE),
)


@cache
def _load(path: Path) -> dict[str, PublishedRow]:
    # Cached because a report asks for the same table once per experiment.
    rows = {}
    with path.open(newline="") as f:
        for record in csv.DictReader(f):
            method = record.pop("method")
            params_text = record.pop("params")
            params = parse_params(params_text)
            ppt_text = record.pop("ppt").strip()
            task_mean = float(record.pop("task_mean"))
            top1 = {column: float(value) for column, value in record.items()}
            ppt_value = None if ppt_text == "-" else float(ppt_text)
            rows[method] = PublishedRow(method, top1, task_mean, params, ppt_value, params_digits(params_text))
    return rows


# Bootstrap intervals: resamples and the generator's seed, fixed so that the same runs give the same report.
RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95

# Fewer shared methods give no ordering worth a coefficient (with two, Spearman's rho can only be +1 or -1).
MIN_RANKED = 3
# Fewer give no bootstrap interval (resamples of three methods draw one of them twice or more in 7 of 9).
MIN_INTERVAL = 4


@dataclass(frozen=True)
class RankCorrelation:
    """How alike two orderings of the same methods are.

    Attributes:
        rho: Spearman's rank correlation (ties get their average rank); NaN below :data:`MIN_RANKED` methods,
            or when one side ranks every method equal.
        methods: the methods compared (those both sides have), in the measured order, best first.
        interval: the 95 % percentile bootstrap interval of ``rho`` (:func:`rank_interval`).

    """

    rho: float
    methods: tuple[str, ...]
    interval: tuple[float, float] = (math.nan, math.nan)

    def describe(self) -> str:
        """``+0.34 (95 % bootstrap interval -0.13 to +0.70)``."""
        low, high = self.interval
        if math.isnan(low):
            # Said, not left out: a coefficient over three rows (+0.50, say) with no interval reads as a firm one.
            return f"{self.rho:+.2f} (no bootstrap interval: {len(self.methods)} rows, it needs {MIN_INTERVAL})"
        return f"{self.rho:+.2f} (95 % bootstrap interval {low:+.2f} to {high:+.2f}, {RESAMPLES} resamples of the rows)"


def rank_correlation(measured: Mapping[str, float], published: Mapping[str, float]) -> RankCorrelation:
    """Spearman's rank correlation between two scores of the methods both mappings hold (NaN scores left out).

    Args:
        measured: method -> score measured here (e.g. a leaderboard row's task mean).
        published: method -> published score, under the same method names.

    Returns:
        The coefficient and the methods it was computed over.

    """
    from scipy.stats import spearmanr  # scipy comes with scikit-learn; loaded only when a ranking is asked for

    shared = [m for m in measured if m in published and not math.isnan(measured[m]) and not math.isnan(published[m])]
    shared.sort(key=lambda m: -measured[m])
    ours, theirs = [measured[m] for m in shared], [published[m] for m in shared]
    if len(shared) < MIN_RANKED or len(set(ours)) == 1 or len(set(theirs)) == 1:
        return RankCorrelation(math.nan, tuple(shared))
    return RankCorrelation(float(spearmanr(ours, theirs).statistic), tuple(shared), rank_interval(ours, theirs))


def rank_interval(measured: Sequence[float], published: Sequence[float]) -> tuple[float, float]:
    """The 95 % percentile bootstrap interval of Spearman's rho, the methods resampled in pairs (seeded).

    NaN below :data:`MIN_INTERVAL` methods, or when no resample ranks anything; a resample in which one side ties
    every method it drew (one method repeated, or methods of one score) is left out of the percentiles.
    """
    import warnings

    import numpy as np
    from scipy import stats

    if len(measured) < MIN_INTERVAL:
        return math.nan, math.nan

    def rho(x: Any, y: Any) -> float:
        if len(set(x)) == 1 or len(set(y)) == 1:
            return math.nan  # a resample of one method repeated ranks nothing
        return float(stats.spearmanr(x, y).statistic)

    with warnings.catch_warnings(), np.errstate(invalid="ignore"):
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        found = stats.bootstrap(
            (np.asarray(measured), np.asarray(published)),
            rho,
            paired=True,
            vectorized=False,
            n_resamples=RESAMPLES,
            method="percentile",
            rng=np.random.default_rng(BOOTSTRAP_SEED),
        )
    # Percentiles of the resamples that rank something (scipy's own interval turns NaN at one such resample).
    ranked = found.bootstrap_distribution[~np.isnan(found.bootstrap_distribution)]
    if not ranked.size:  # one side ties every method: no resample ranks anything
        return math.nan, math.nan
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.percentile(ranked, [tail, 100 - tail])
    return float(low), float(high)


def table_for(task: str) -> PublishedTable | None:
    """The published table covering petl dataset ``task``, if any (mini tasks have none)."""
    return next((t for t in TABLES if t.covers(task)), None)
