r"""How often does a 95 % mean-rank interval cover the true mean rank?  The simulation the ranking docs quote.

Each table is k methods over n blocks: method i scores ``means[i]`` plus normal noise of sd 1 in every block, the
means evenly spread ``gap`` apart, so method i's true mean rank is 1 + the sum over the others of P(their score is
above its).  Per (k, n, gap), ``--tables`` seeded tables; for each, three intervals of every method's mean rank:

* the leaderboard's (:func:`petl.bench.ranking.mean_rank_interval`: Student t over the blocks, at least the exact
  binomial floor, clipped to 1 and k);
* the same t interval without its floor;
* a 95 % percentile bootstrap over the blocks (``--resamples`` resamples of the blocks' rank rows).

A cell of the printed table is the share of (table, method) pairs whose interval covers the true mean rank; the
last columns are the first's and the last method's alone.  k covers the committed boards (9 and 27 rows, and 5),
n their 6 and 7 tasks and 3 (a user's seeds); gap 0.05 (methods nearly alike), 0.25 (neighbours overlap) and 2.5
(far apart: each method ranks nearly the same in every block).  Usage (about a minute on one core):

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/rank_interval_coverage.py \
        > benchmarks/results/rank_interval_coverage.md
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from scipy import stats

from petl.bench.ranking import mean_rank_interval

METHODS = (5, 9, 27)
BLOCKS = (3, 6, 7)
GAPS = (0.05, 0.25, 2.5)


def true_mean_ranks(means: np.ndarray) -> np.ndarray:
    """1 + the sum over the other methods of P(their score > this one's), scores ``means`` + N(0, 1) noise."""
    above = stats.norm.cdf((means[None, :] - means[:, None]) / math.sqrt(2))  # [i, j]: P(j scores above i)
    return 1 + above.sum(axis=1) - 0.5  # less P(i above itself), 0.5


def coverage(k: int, n: int, gap: float, tables: int, resamples: int, seed: int) -> dict[str, np.ndarray]:
    """Per interval, per method: the share of ``tables`` seeded tables whose interval covers the true mean rank."""
    means = gap * np.arange(k - 1, -1, -1, dtype=float)
    true = true_mean_ranks(means)
    rng = np.random.default_rng(seed)
    covered = {name: np.zeros(k) for name in ("leaderboard", "t, no floor", "bootstrap")}
    t = stats.t.ppf(0.975, n - 1)
    for _ in range(tables):
        ranks = stats.rankdata(-(means + rng.standard_normal((n, k))), axis=1)
        low, high = mean_rank_interval(ranks)
        covered["leaderboard"] += (low <= true) & (true <= high)
        half = t * ranks.std(axis=0, ddof=1) / math.sqrt(n)
        mid = ranks.mean(axis=0)
        covered["t, no floor"] += (np.clip(mid - half, 1, k) <= true) & (true <= np.clip(mid + half, 1, k))
        drawn = ranks[rng.integers(0, n, size=(resamples, n))].mean(axis=1)  # resamples x k mean ranks
        low, high = np.percentile(drawn, [2.5, 97.5], axis=0)
        covered["bootstrap"] += (low <= true) & (true <= high)
    return {name: c / tables for name, c in covered.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=400, help="seeded tables per (k, n, gap)")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples per table")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("# Coverage of 95 % mean-rank intervals (simulation)\n")
    print(
        f"`benchmarks/rank_interval_coverage.py --tables {args.tables} --resamples {args.resamples} --seed "
        f"{args.seed}`: share of (table, method) pairs whose interval covers the true mean rank; first / last: "
        "the best and the worst method alone.\n"
    )
    columns = ("k", "n", "gap", "leaderboard", "t, no floor", "bootstrap", "leaderboard first / last")
    print("| " + " | ".join((*columns, "t, no floor first / last")) + " |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in METHODS:
        for n in BLOCKS:
            for gap in GAPS:
                found = coverage(k, n, gap, args.tables, args.resamples, args.seed)
                ends = {name: f"{c[0]:.2f} / {c[-1]:.2f}" for name, c in found.items()}
                print(
                    f"| {k} | {n} | {gap:g} | {found['leaderboard'].mean():.2f} | {found['t, no floor'].mean():.2f} | "
                    f"{found['bootstrap'].mean():.2f} | {ends['leaderboard']} | {ends['t, no floor']} |"
                )


if __name__ == "__main__":
    main()
