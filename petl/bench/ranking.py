"""Which differences on a leaderboard are real: a rank test across blocks, and the flags on cells not to lean on.

The test is Demšar's (JMLR 7, 2006) for comparing several methods over several data sets: Friedman's test
(:func:`scipy.stats.friedmanchisquare`) on the methods' ranks within each block, then Nemenyi's post-hoc test of
every pair (:func:`scikit_posthocs.posthoc_nemenyi_friedman`), drawn as a critical-difference diagram
(:func:`scikit_posthocs.critical_difference_diagram`).  Only complete rows (every task, every seed) take part.

**Two methods.**  Friedman's test needs three; for two, Demšar's section 3.1.2 gives the sign test, here exact
(:func:`sign_test`).  Nemenyi's test of two methods is that test's normal approximation, which declared a method
that won each of 4 blocks better (p = 0.046), where the exact test's p cannot go below 0.125 over 4 blocks.

**The block.**  With two or more tasks the block is the task, its cell the mean of the seeds: a claim that one
method beats another is a claim across tasks, and the seeds of one task share its data, so counting them as
blocks would count one task three times.  With one task (a user's folder) the seeds are the only blocks there
are (task x seed): a claim about this data, not about other data.

**The flags.**  A cell with a seed far from the others (:data:`FAR_SEED_POINTS`; three seeds or more), a cell
whose val curve was still rising at its last epochs (:data:`RISING_POINTS`), and a task every row has saturated
(:data:`SATURATED_POINTS`), which is left out of the ranks (every method ties there up to a few test images)
and kept in the table.

scipy and scikit-posthocs (with pandas) load inside the functions: ``petl-bench --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from petl.bench.board import ExperimentRow, Leaderboard
from petl.bench.published import CONFIDENCE
from petl.utils.text import plural

ALPHA = 0.05

# A seed more than this many points of test top-1 from its cell's median (with three seeds: from the middle
# one) is "far from the others".  On the committed boards the seeds of a cell usually lie within 2 points
# of each other; 10 points is five times that, and far beyond what two seeds of a run that learned the same
# thing differ by, so a flagged cell's mean stands between two outcomes rather than around one.
FAR_SEED_POINTS = 10.0
# A cell is "still learning" when the val top-1 of the trial it was selected from (without one, the mean over its
# seeds' own curves) rose by at least this many points over the last 20 % of its epochs (CSV
# <task>_val_tail_change).  On val200 one image is 0.5 points and one accuracy near 60 % has a binomial standard
# deviation of about 3.5 points, so the difference of two epochs' accuracies has about 5: 10 points is twice that, a
# rise noise alone rarely makes.
RISING_POINTS = 10.0
# A task is saturated when every complete row's mean is within this many points of 100 %: the methods then
# differ by a few test images there, and their order on it says nothing.
SATURATED_POINTS = 2.0
# Scores are compared at this many decimals before ranking: two cells that got the same test images right in sum
# are one score, but their means, summed in another order, may differ in the last bit (the committed DINOv2 board's
# gps and ssf on fashion_mnist, 80.6 + 82.8 + 83.0 and 83.4 + 81.6 + 81.4: 82.13333333333333 against
# 82.13333333333334), and ranked apart they would move the mean ranks and Friedman's statistic.  Far below
# one image's share of a mean (100 / (images x seeds): 2e-5 points over a million images and five seeds).
TIE_DIGITS = 9


def score_key(value: float) -> float:
    """``value`` at :data:`TIE_DIGITS` decimals: what scores are ordered and tied by wherever a board compares them
    (its rows' order, petl-bench choose's answer, compare's places), as the rank test does.
    """
    return round(value, TIE_DIGITS)


def seed_scores(row: ExperimentRow, task: str) -> dict[int, float]:
    """Test top-1 of each seed of ``row``'s cell on ``task`` (not of a seed the cell leaves out: outside its suite)."""
    seeds = set(row.scores[task].seeds) if task in row.scores else set()
    return {r.seed: float(r.result.test_top1) for r in row.runs if r.task == task and r.seed in seeds}


def far_seeds(scores: Mapping[int, float], points: float = FAR_SEED_POINTS) -> tuple[int, ...]:
    """The seeds more than ``points`` from the median of the cell's seeds (none below three seeds)."""
    if len(scores) < 3:
        return ()
    middle = statistics.median(scores.values())
    # At score_key's precision: 19.1 - 9.1 is 10.000000000000002 and 80.6 - 70.6 is 10.0, both ten points.
    return tuple(sorted(seed for seed, value in scores.items() if score_key(abs(value - middle)) > points))


def saturated_tasks(
    board: Leaderboard, points: float = SATURATED_POINTS, rows: Sequence[ExperimentRow] | None = None
) -> list[str]:
    """The tasks the means count (:attr:`~petl.bench.board.Leaderboard.counted_tasks`) on which every complete row's
    mean is within ``points`` of 100 % (none without complete rows).

    ``rows``: the complete rows among these (default: the board's), as :func:`rank_test` ranks them: whether the
    rows compared differ by a few test images is theirs to say, not a row outside the comparison's.
    Not a task outside the board's suite: it is in no mean and no block, and marked as such, not as left out.
    """
    complete = [row for row in (rows if rows is not None else board.rows) if board.complete(row)]
    if not complete:
        return []
    return [
        t for t in board.counted_tasks if all(t in r.scores and r.scores[t].mean >= 100.0 - points for r in complete)
    ]


@dataclass(frozen=True)
class Ranking:
    """The rank test of a board's complete rows.

    Attributes:
        block: ``task`` (a cell per task, the mean of its seeds) or ``seed`` (one task, a block per seed).
        blocks: the blocks' names.
        left_out_tasks: saturated tasks, not ranked.
        methods: the ranked experiments, best mean rank first.
        mean_rank: per experiment, its mean rank over the blocks (1 = best in a block, ties averaged).
        interval: per experiment, the 95 % Student t interval of its mean rank over the blocks, at least
            :func:`rank_floor` either side and within 1 and k (:func:`mean_rank_interval`; NaN with one block).
        statistic: Friedman's chi-square; NaN with two methods (the test needs three).
        p_value: Friedman's p; NaN with two methods.
        p_values: Nemenyi's p of every pair, ``p_values[a][b]``; with two methods, the exact sign test's
            (:func:`sign_test`).
        critical_difference: the mean-rank difference Nemenyi's test needs at :data:`ALPHA`; NaN with two methods
            (the sign test's p is not a gap in mean rank once blocks tie).
        groups: maximal runs of methods (in mean-rank order) no two of which differ, best first.
        task: with block ``seed``, the one task whose seeds are the blocks (the others left out as saturated).

    """

    block: str
    blocks: tuple[str, ...]
    left_out_tasks: tuple[str, ...]
    methods: tuple[str, ...]
    mean_rank: dict[str, float]
    interval: dict[str, tuple[float, float]]
    statistic: float
    p_value: float
    p_values: dict[str, dict[str, float]]
    critical_difference: float
    groups: tuple[tuple[str, ...], ...] = field(default=())
    alpha: float = ALPHA
    task: str = ""

    @property
    def pair_test(self) -> str:
        """The test of a pair, as a sentence names it: Nemenyi's, or with two methods the exact sign test."""
        return "Nemenyi's test" if len(self.methods) >= 3 else "the exact sign test"

    @property
    def omnibus_rejects(self) -> bool:
        """Whether Friedman's test rejects that every method ranks alike.

        With two methods it is not run, so yes (the sign test decides alone); with three or more and every block
        tied (no statistic, p NaN), no.
        """
        if len(self.methods) < 3:
            return True
        return self.p_value < self.alpha  # NaN (every block tied) compares False

    def too_few_blocks(self) -> str:
        """Why no outcome over these blocks could declare two methods different, or ``""`` when one could.

        The most extreme outcome is one order in every block: mean ranks 1 to k, Friedman's statistic n (k - 1).
        Where even that does not pass (its p at or above :attr:`alpha`, or a gap of k - 1 mean ranks within the
        critical difference; with two methods, the sign test's p of one winning every block), the test's "no pair
        differs" is a count of blocks, not a finding.
        """
        from scipy import stats

        k, n = len(self.methods), len(self.blocks)
        if k < 3:
            if (best := sign_test(n, 0, 0)) >= self.alpha:
                return f"the sign test's p cannot go below {best:.3g} over {n} blocks, however the two rank"
            return ""
        if k >= 3 and (best := float(stats.chi2.sf(n * (k - 1), k - 1))) >= self.alpha:
            return f"Friedman's p cannot go below {best:.2g} over {n} blocks, however the methods rank"
        if k - 1 <= self.critical_difference:
            return (
                f"the largest gap in mean rank there can be, {k - 1} (one method first in every block, another last), "
                f"is within the critical difference, {self.critical_difference:.2f}"
            )
        return ""

    def differ(self, a: str, b: str) -> bool:
        """Whether ``a`` and ``b`` differ at :attr:`alpha`: Friedman rejects, then Nemenyi does for the pair (with two
        methods, the exact sign test alone).
        """
        return self.omnibus_rejects and self.p_values[a][b] < self.alpha

    def letters(self, method: str) -> str:
        """The groups ``method`` belongs to, as letters (``a`` is the group of the best mean rank)."""
        return "".join(letter(i) for i, group in enumerate(self.groups) if method in group)


def show_p(p: float, alpha: float = ALPHA) -> str:
    """``p`` to two significant digits, or more where two would round a p below ``alpha`` up to it (0.0498 is not
    shown as 0.05 beside a verdict that it is below 0.05).
    """
    for digits in range(2, 17):
        text = f"{p:.{digits}g}"
        if not p < alpha <= float(text):
            return text
    return repr(p)


def said_p(p: float, alpha: float = ALPHA) -> str:
    """``p = 0.011`` (:func:`show_p`), or ``p < 1e-300`` where scipy's p underflowed to 0 (Friedman's over some 58
    tasks of 27 methods in one order): it is below the smallest double, not 0.
    """
    return "p < 1e-300" if p == 0 else f"p = {show_p(p, alpha)}"


def letter(index: int) -> str:
    """The name of group ``index``: ``a``, ``b``, ... (``g26`` past ``z``)."""
    letters = string.ascii_lowercase
    return letters[index] if index < len(letters) else f"g{index}"


def rank_test(board: Leaderboard, rows: Sequence[ExperimentRow] | None = None, alpha: float = ALPHA) -> Ranking | str:
    """Rank ``rows`` (default: the board's complete rows) across blocks; or why no test was run.

    The blocks are the board's tasks less those ``rows`` saturate (:func:`saturated_tasks`) when two or more
    remain, else the seeds of the one task left (those every row ran); with every task saturated, no test.
    """
    import numpy as np

    rows = [r for r in (rows if rows is not None else board.rows) if board.complete(r)]
    if len(rows) < 2:
        return f"{plural(len(rows), 'complete row')}: a comparison needs two"
    left_out = saturated_tasks(board, rows=rows)
    # The tasks every ranked row ran (a plan's; a task only an incomplete row reached is no block).
    tasks = [t for t in board.counted_tasks if t not in left_out and all(t in r.scores for r in rows)]
    if len(tasks) >= 2:
        block, blocks = "task", tuple(tasks)
        values = np.array([[r.scores[t].mean for r in rows] for t in tasks])
    elif not tasks:
        # Ranking the seeds of a saturated task would rank a few test images, while the legend leaves it out.
        said = ", ".join(t.rsplit("/", 1)[-1] for t in left_out)
        return f"every task is saturated ({said}): the methods differ there by a few test images, which rank nothing"
    else:
        task = tasks[0]
        ran = {r.experiment: set(seed_scores(r, task)) for r in rows}
        seeds = sorted(set.intersection(*ran.values()))
        if len(seeds) < 2 and any(len(s) >= 2 for s in ran.values()):
            # The rows have the seeds, not the same ones: more seeds of each would not help, the same ones would.
            said = "; ".join(f"{e}: {', '.join(map(str, sorted(s)))}" for e, s in ran.items())
            return (
                f"the complete rows share {plural(len(seeds), 'seed')} of the one task ({said}): a comparison needs "
                "two seeds every row ran; run the same seeds for every experiment"
            )
        block, blocks = "seed", tuple(f"seed {s}" for s in seeds)
        values = np.array([[seed_scores(r, task)[s] for r in rows] for s in seeds])
    if len(blocks) < 2:
        return f"{plural(len(blocks), block)} to rank over: a comparison needs two (seeds=0,1,2 gives three)"
    found = rank_scores([r.experiment for r in rows], values, block, blocks, tuple(left_out), alpha)
    return found if block == "task" else dataclasses.replace(found, task=tasks[0])


def rank_scores(
    names: Sequence[str],
    values: Any,
    block: str = "task",
    blocks: Sequence[str] | None = None,
    left_out: tuple[str, ...] = (),
    alpha: float = ALPHA,
) -> Ranking:
    """The rank test of a table of scores: ``values[i][j]`` is method ``names[j]``'s score in block ``i``.

    Args:
        names: the methods, one per column.
        values: blocks x methods, higher is better.
        block: what a block is (``task`` or ``seed``), for the sentences that describe the test.
        blocks: the blocks' names (default: ``1``, ``2``, ...).
        left_out: tasks left out of the blocks (saturated), for those sentences.
        alpha: the level of every test.

    """
    import numpy as np
    import scikit_posthocs
    from scipy import stats

    names = list(names)
    values = np.asarray(values, dtype=float)
    if values.ndim != 2 or values.shape[1] != len(names) or len(names) < 2 or not len(values):
        raise ValueError(f"rank_scores needs blocks x methods scores of two methods or more, got shape {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError("rank_scores: a score is NaN or infinite; rank only complete rows of measured scores")
    values = values.round(TIE_DIGITS)  # one score summed in two orders is one score (score_key)
    blocks = tuple(blocks) if blocks is not None else tuple(str(i + 1) for i in range(len(values)))
    # Rank 1 = the best accuracy in a block; ties share their mean rank.
    ranks = stats.rankdata(-values, axis=1)
    means = ranks.mean(axis=0)
    low, high = mean_rank_interval(ranks)
    k, n = len(names), len(blocks)
    statistic = p_value = math.nan
    if k >= 3:
        with np.errstate(divide="ignore", invalid="ignore"):  # every block tied: no statistic
            found = stats.friedmanchisquare(*values.T)
        statistic, p_value = float(found.statistic), float(found.pvalue)
    if k >= 3:
        pair = scikit_posthocs.posthoc_nemenyi_friedman(values).to_numpy()
        # Nemenyi's critical difference (Demšar 2006, eq. 5): q_alpha is the studentized range over sqrt(2).
        q = stats.studentized_range.ppf(1 - alpha, k, np.inf) / math.sqrt(2)
        critical_difference = float(q * math.sqrt(k * (k + 1) / (6 * n)))
    else:
        wins = int((ranks[:, 0] < ranks[:, 1]).sum())
        ties = int((ranks[:, 0] == ranks[:, 1]).sum())
        p = sign_test(wins, n - wins - ties, ties)
        pair = np.array([[1.0, p], [p, 1.0]])
        critical_difference = math.nan
    p_values = {a: {b: float(pair[i, j]) for j, b in enumerate(names)} for i, a in enumerate(names)}
    order = sorted(range(k), key=lambda i: (means[i], names[i]))
    ranking = Ranking(
        block=block,
        blocks=blocks,
        left_out_tasks=left_out,
        methods=tuple(names[i] for i in order),
        mean_rank={names[i]: float(means[i]) for i in order},
        interval={names[i]: (float(low[i]), float(high[i])) for i in order},
        statistic=statistic,
        p_value=p_value,
        p_values=p_values,
        critical_difference=critical_difference,
        alpha=alpha,
    )
    return _with_groups(ranking)


def sign_test(wins: int, losses: int, ties: int) -> float:
    """The exact two-sided sign test's p of one method winning ``wins`` blocks against another's ``losses``.

    Ties count half for each, an odd one left out (Demšar 2006, section 3.1.2: a tie is evidence for the null, not
    nothing); the p is :func:`scipy.stats.binomtest`'s of the wins so counted, 1 when every block ties.
    """
    from scipy import stats

    n = wins + losses + ties - ties % 2
    return float(stats.binomtest(wins + ties // 2, n).pvalue) if n else 1.0


def mean_rank_interval(ranks: Any, confidence: float = CONFIDENCE) -> tuple[Any, Any]:
    """The Student t interval of each method's mean rank, never narrower than the floor n blocks allow.

    Each method gets mean ± max(t(n - 1) · sd / √n, floor) of its ranks in the n blocks, clipped to 1 and k.  The
    floor is :func:`rank_floor`: a method that took the same rank in every block has no spread, and its t interval
    would be a point, a certainty that n blocks cannot give.

    Args:
        ranks: blocks x methods, each row the methods' ranks in one block (1 to k, ties averaged).
        confidence: the interval's level.

    Returns:
        The low and high ends per method, within 1 and k (a mean rank lies there); NaN with one block (no spread to
        measure).

    """
    import numpy as np
    from scipy import stats

    ranks = np.asarray(ranks, dtype=float)
    n, k = ranks.shape
    if n < 2:
        return np.full(k, np.nan), np.full(k, np.nan)
    # Not a bootstrap over the blocks: in simulation over the 6-7 blocks of the committed boards (5 to 27 methods whose
    # neighbours overlap) a percentile bootstrap covered the true mean rank 84-89 % of the time (72-78 % over 3
    # blocks), this interval 93-94 % (90-95 % over 3 blocks); the bootstrap, like the t interval without its floor,
    # shrinks to a point where a method ranks the same in every block (benchmarks/rank_interval_coverage.py, its
    # table in benchmarks/results/rank_interval_coverage.md; tests/bench/test_ranking.py checks coverage with the
    # methods close and far apart).  Nor a width from a bound on the ranks' variance: the largest a mean rank m can
    # have, (m - 1)(k - m) (Wilson's interval on the scaled rank), or Friedman's null variance, (k² - 1) / 12, gives
    # a middle method of 27 over 6 blocks about ± 14 and ± 8 ranks (by t(5)) whatever its ranks; the floor widens
    # only the intervals whose ranks barely move.
    half = stats.t.ppf((1 + confidence) / 2, n - 1) * ranks.std(axis=0, ddof=1) / np.sqrt(n)
    half = np.maximum(half, rank_floor(n, confidence))
    means = ranks.mean(axis=0)
    return np.clip(means - half, 1.0, k), np.clip(means + half, 1.0, k)


def rank_floor(n: int, confidence: float = CONFIDENCE) -> float:
    """The narrowest half-width of a mean-rank interval over ``n`` blocks: 1 - ((1 - confidence) / 2) ** (1 / n).

    A method seen at one rank in all ``n`` blocks may still take another in a share of the blocks not seen: the
    exact (Clopper-Pearson) upper bound on that share after 0 of ``n`` (:func:`scipy.stats.binomtest`'s
    ``proportion_ci``), 0.46 over 6 blocks.  Taking the next rank in that share moves the mean rank by as much.  A
    floor, not a bound: a method that moved further than one place would lie further off.
    """
    from scipy import stats

    return float(stats.binomtest(0, n).proportion_ci(confidence_level=confidence).high)


def _with_groups(ranking: Ranking) -> Ranking:
    # The groups a critical-difference diagram draws as bars: from each method, the longest run of methods after
    # it (in mean-rank order) no two of which differ; a run inside another is not a group of its own.
    methods = ranking.methods
    runs: list[tuple[str, ...]] = []
    for i in range(len(methods)):
        j = i
        while j + 1 < len(methods) and not any(ranking.differ(m, methods[j + 1]) for m in methods[i : j + 1]):
            j += 1
        run = methods[i : j + 1]
        if not any(set(run) <= set(kept) for kept in runs):
            runs.append(run)
    return Ranking(**{**ranking.__dict__, "groups": tuple(runs)})


def critical_difference_png(ranking: Ranking, title: str) -> bytes:
    """``critical_difference.png``: the methods on their mean-rank axis, a bar joining those that do not differ.

    Drawn by :func:`scikit_posthocs.critical_difference_diagram` on a matplotlib Figure (Agg, no pyplot state),
    from the same p values the report prints (all 1 where Friedman's test does not reject).
    """
    import pandas as pd
    import scikit_posthocs
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from petl.bench.plot import _png

    methods = list(ranking.methods)
    shown = [[ranking.p_values[a][b] if ranking.omnibus_rejects else 1.0 for b in methods] for a in methods]
    fig = Figure(figsize=(10, 1.2 + 0.2 * len(methods)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    drawn = scikit_posthocs.critical_difference_diagram(
        pd.Series(ranking.mean_rank),
        pd.DataFrame(shown, index=methods, columns=methods),
        ax=ax,
        alpha=ranking.alpha,
        label_fmt_left="{label} ({rank:.1f})",
        label_fmt_right="({rank:.1f}) {label}",
    )
    # Each bar is a line through its methods' ranks in the order of a set, which changes with the process's string
    # hashing; drawn left to right, the same bar gives the same pixels in every process.
    for lines in drawn["crossbars"]:
        for line in lines:
            line.set_xdata(sorted(line.get_xdata()))
    ax.set_title(title, fontsize=9, pad=24)
    fig.tight_layout()
    return _png(fig)
