"""Which differences on a leaderboard are real (issue 50): the rank test, the cell flags, the rank correlation's
interval, and the choose answer that rests on the test."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from test_committed_leaderboards import _result, _write

from petl.bench import choice, ranking, report
from petl.bench.published import rank_correlation, rank_interval

pytest.importorskip("scikit_posthocs")

# 5 blocks (tasks) x 4 methods, written by hand: A wins most blocks, D loses most, one tie (block 4: B = C).
NAMES = ["A", "B", "C", "D"]
TABLE = [
    [90.0, 85.0, 80.0, 70.0],
    [88.0, 86.0, 75.0, 72.0],
    [70.0, 72.0, 65.0, 60.0],
    [95.0, 90.0, 90.0, 85.0],
    [60.0, 55.0, 58.0, 40.0],
]


def test_friedman_nemenyi_and_the_critical_difference_match_the_libraries_and_the_formulas():
    from scikit_posthocs import posthoc_nemenyi_friedman
    from scipy.stats import friedmanchisquare

    found = ranking.rank_scores(NAMES, TABLE)
    # Mean ranks by hand: A 1,1,2,1,1 -> 1.2; B 2,2,1,2.5,3 -> 2.1; C 3,3,3,2.5,2 -> 2.7; D 4 everywhere.
    assert found.mean_rank == pytest.approx({"A": 1.2, "B": 2.1, "C": 2.7, "D": 4.0})
    assert found.methods == ("A", "B", "C", "D")
    expected = friedmanchisquare(*np.array(TABLE).T)
    assert found.statistic == pytest.approx(expected.statistic) and found.p_value == pytest.approx(expected.pvalue)
    # Friedman's statistic by its formula, corrected for the one tie (scipy divides by 1 - sum(t^3 - t)/(n k (k^2-1))).
    n, k, ranks = 5, 4, np.array([1.2, 2.1, 2.7, 4.0])
    plain = 12 * n / (k * (k + 1)) * np.sum((ranks - (k + 1) / 2) ** 2)
    assert found.statistic == pytest.approx(plain / (1 - (2**3 - 2) / (n * k * (k * k - 1))))
    p = posthoc_nemenyi_friedman(np.array(TABLE)).to_numpy()
    for i, a in enumerate(NAMES):
        for j, b in enumerate(NAMES):
            assert found.p_values[a][b] == pytest.approx(p[i, j])
    # Demšar (2006) Table 5a: q_0.05 = 2.569 for four methods; CD = q sqrt(k (k + 1) / (6 N)).
    assert found.critical_difference == pytest.approx(2.569 * math.sqrt(4 * 5 / (6 * 5)), abs=1e-3)
    # A and D lie 2.8 mean ranks apart (> CD 2.10): the one pair that differs.
    assert [(a, b) for a in NAMES for b in NAMES if a < b and found.differ(a, b)] == [("A", "D")]
    assert found.groups == (("A", "B", "C"), ("B", "C", "D"))
    assert [found.letters(m) for m in NAMES] == ["a", "ab", "ab", "b"]


def test_equal_scores_summed_in_another_order_tie_in_the_ranks():
    import statistics

    from scipy.stats import friedmanchisquare

    # The committed DINOv2 board's fashion_mnist: gps and ssf got the same test images right over their three seeds,
    # and their means differ in the last bit (82.13333333333333 against 82.13333333333334).
    gps, ssf = statistics.fmean([80.6, 82.8, 83.0]), statistics.fmean([83.4, 81.6, 81.4])
    assert gps != ssf
    table = [[gps, ssf, 70.0], [90.0, 80.0, 70.0], [60.0, 80.0, 70.0]]
    found = ranking.rank_scores(["gps", "ssf", "linear"], table)
    # Block 1 ties the two at 1.5 each, as one score written twice does: gps 1.5, 1, 3; ssf 1.5, 2, 1; linear 3, 3, 2.
    assert found.mean_rank == pytest.approx({"gps": 5.5 / 3, "ssf": 1.5, "linear": 8 / 3})
    tied = [[82.0, 82.0, 70.0], [90.0, 80.0, 70.0], [60.0, 80.0, 70.0]]
    assert found.statistic == pytest.approx(friedmanchisquare(*np.array(tied).T).statistic)


@pytest.mark.parametrize(
    ("names", "values", "said"),
    [
        (["a", "b", "c"], [[1.0, math.nan, 2.0], [1.0, 2.0, 3.0]], "NaN or infinite"),
        (["a", "b", "c"], [[1.0, math.inf, 2.0], [1.0, 2.0, 3.0]], "NaN or infinite"),
        (["a"], [[1.0], [2.0]], "two methods or more"),
        (["a", "b"], [[1.0, 2.0, 3.0]], "two methods or more"),
    ],
)
def test_scores_no_rank_test_can_take_are_refused_in_one_line(names, values, said):
    # A NaN ranked every mean rank NaN and drew one group; one method raised an IndexError.
    with pytest.raises(ValueError, match=said):
        ranking.rank_scores(names, values)


def test_the_mean_rank_interval_is_a_student_t_interval_over_the_blocks():
    found = ranking.rank_scores(NAMES, TABLE)
    # B ranks 2, 2, 1, 2.5, 3: mean 2.1, sd sqrt(2.2 / 4); t(4) at 0.975 is 2.776.
    half = 2.776 * math.sqrt(2.2 / 4) / math.sqrt(5)
    assert found.interval["B"] == pytest.approx((2.1 - half, 2.1 + half), abs=1e-3)
    # A ranks 1, 1, 2, 1, 1: mean 1.2 - 0.555 lies below the best rank there is, so the interval stops at 1.
    assert found.interval["A"] == pytest.approx((1.0, 1.2 + 2.776 * math.sqrt(0.2) / math.sqrt(5)), abs=1e-3)
    # D is last in every block: no spread, so the floor of 5 blocks, 1 - 0.025 ** (1 / 5) = 0.522, below 4 (and none
    # above: no mean rank lies past 4).
    assert found.interval["D"] == pytest.approx((4.0 - 0.522, 4.0), abs=1e-3)


def test_a_method_with_the_same_rank_in_every_block_gets_the_exact_binomial_floor_within_1_and_k():
    from scipy import stats

    # Six blocks in one order: every method's ranks are constant and the t interval would be a point.
    low, high = ranking.mean_rank_interval([[1.0, 2.0, 3.0, 4.0, 5.0]] * 6)
    floor = stats.binomtest(0, 6).proportion_ci(confidence_level=0.95).high  # Clopper-Pearson after 0 of 6
    assert floor == pytest.approx(1 - 0.025 ** (1 / 6)) == pytest.approx(0.459, abs=1e-3)
    assert low == pytest.approx([1.0, 2 - floor, 3 - floor, 4 - floor, 5 - floor])
    assert high == pytest.approx([1 + floor, 2 + floor, 3 + floor, 4 + floor, 5.0])
    assert (high - low > 0.4).all() and (low >= 1.0).all() and (high <= 5.0).all()
    # A method whose rank barely moves (once by one place) keeps at least the floor too.
    low, high = ranking.mean_rank_interval([[1.0, 2.0, 3.0, 4.0]] * 5 + [[1.0, 3.0, 2.0, 4.0]])
    assert high[1] - low[1] >= 2 * floor - 1e-9 and high[2] - low[2] >= 2 * floor - 1e-9


def _coverage(spread: float, k: int = 5, n: int = 6, tables: int = 150) -> tuple[np.ndarray, float]:
    """Per method, the share of seeded tables whose interval covers its true mean rank; and the mean width.

    Each table is k methods over n blocks (the committed boards have 6 and 7) whose scores are the methods' means,
    evenly spread over ``spread``, plus normal noise of sd 1: a method's true mean rank is 1 + the sum over the others
    of P(their score > its score).
    """
    from scipy import stats

    means = np.linspace(spread, 0.0, k)
    beats = stats.norm.cdf((means[None, :] - means[:, None]) / math.sqrt(2))  # [j, i]: P(i scores above j)
    true = 1 + beats.sum(axis=1) - 0.5  # less P(j above itself), 0.5
    names = [f"m{i}" for i in range(k)]
    rng = np.random.default_rng(0)
    covered, width = np.zeros(k), 0.0
    for _ in range(tables):
        found = ranking.rank_scores(names, means + rng.standard_normal((n, k)))
        covered += [found.interval[m][0] <= t <= found.interval[m][1] for m, t in zip(names, true, strict=True)]
        width += sum(found.interval[m][1] - found.interval[m][0] for m in names)
    return covered / tables, width / (tables * k)


def test_the_mean_rank_interval_covers_the_true_mean_rank_about_as_often_as_it_says():
    """Methods whose neighbours overlap (means 0.25 apart, noise sd 1).

    A percentile bootstrap over the blocks, the interval before the t interval, covers less: 0.87 against this one's
    0.93 in this setting (k 5, n 6, gap 0.25) of benchmarks/rank_interval_coverage.py, over 400 tables; too few
    blocks for the resamples to show the spread.
    """
    covered, _ = _coverage(spread=1.0)
    # Above 0.90, and short of 0.98: an interval from 1 to k would cover always and say nothing.
    assert 0.90 <= covered.mean() <= 0.98


def test_the_mean_rank_interval_of_methods_far_apart_does_not_shrink_to_a_point():
    """Methods 2.5 noise sds apart rank nearly the same in every block: the t interval without its floor (sd often 0)
    covered the first's true mean rank 0.22 of the time, the last's 0.24 (benchmarks/rank_interval_coverage.py, k 5,
    n 6, gap 2.5, 400 tables); with the floor every method's is covered in all 150 tables here, by intervals under
    one rank wide on average.
    """
    covered, width = _coverage(spread=10.0)
    assert covered.min() >= 0.95
    assert width < 1.0  # an interval from 1 to k (4 wide here) would cover always and say nothing


def test_the_mean_rank_interval_of_one_block_is_none_and_of_tied_blocks_is_the_floor(tmp_path):
    from petl.bench.notes import comparison_lines

    low, high = ranking.mean_rank_interval([[1.0, 2.0, 3.0]])
    assert np.isnan(low).all() and np.isnan(high).all()  # one block: no spread to measure
    tied = ranking.rank_scores(["A", "B", "C"], [[5.0, 5.0, 5.0], [7.0, 7.0, 7.0]])
    floor = ranking.rank_floor(2)  # every method ranks 2 in both blocks: the floor either side, 0.84 over 2 blocks
    assert tied.interval == {m: pytest.approx((2.0 - floor, 2.0 + floor)) for m in "ABC"}
    # rank_test asks for two blocks; should a one-block ranking reach the report, its table shows no figures.
    for task, row in zip(("mini/digits", "mini/mnist"), TABLE, strict=False):
        for method, top1 in zip(NAMES, row, strict=True):
            _board_run(tmp_path, task, method, 0, top1)
    board = report.build_board(tmp_path)
    board.ranking = ranking.rank_scores(NAMES, TABLE[:1], blocks=["mini/digits"])
    assert {row[2][0] for row in report.rank_table(board).rows} == {"–"}
    assert "**Mean rank interval**: none over one block." in comparison_lines(board)


def test_a_friedman_test_that_does_not_reject_makes_one_group():
    # Every method wins one block and loses another: no order across blocks.
    found = ranking.rank_scores(["A", "B", "C"], [[3, 2, 1], [1, 3, 2], [2, 1, 3], [3, 1, 2]])
    assert not found.omnibus_rejects and found.p_value > 0.05
    assert found.groups == (found.methods,) and not found.differ("A", "B")


def test_a_pair_past_the_critical_difference_that_friedman_keeps_is_said_not_to_differ(tmp_path):
    """Nemenyi's test is not nested in Friedman's: a gap past the critical difference may stand beside a Friedman
    p over α, and the section says why that pair is not declared different (scipy and scikit-posthocs agree)."""
    from scikit_posthocs import posthoc_nemenyi_friedman
    from scipy.stats import friedmanchisquare

    from petl.bench.notes import comparison_lines

    tasks = ("mini/digits", "mini/mnist", "mini/clevr_count", "mini/dsprites_loc")
    table = [[10.0, 30.0, 40.0, 20.0], [40.0, 20.0, 30.0, 10.0], [30.0, 20.0, 40.0, 10.0], [20.0, 30.0, 40.0, 10.0]]
    assert friedmanchisquare(*np.array(table).T).pvalue > 0.05
    assert posthoc_nemenyi_friedman(np.array(table)).to_numpy()[2, 3] < 0.05  # C (mean rank 1.25) and D (3.75)
    for task, row in zip(tasks, table, strict=True):
        for method, top1 in zip(NAMES, row, strict=True):
            _board_run(tmp_path, task, method, 0, top1)
    board = report.build_board(tmp_path)
    found = board.ranking
    assert found.mean_rank["D"] - found.mean_rank["C"] == 2.5 > found.critical_difference
    assert not found.differ("C", "D") and found.groups == (found.methods,)
    nemenyi = next(line for line in comparison_lines(board) if line.startswith("**Nemenyi's"))
    assert nemenyi.endswith(
        "more than 2.35 apart (the critical difference); 0 of the 6 pairs do (1 pair lies that far apart, but "
        "Friedman's test above does not reject, so it is not declared different)."
    )


@pytest.mark.parametrize(
    ("a", "b", "sign"),
    [
        ([2.0] * 4, [1.0] * 4, (4, 4)),  # won every block of 4: Nemenyi's approximation said p = 0.046
        ([2.0] * 5, [1.0] * 5, (5, 5)),  # of 5: 0.025 against the exact 0.0625
        ([2.0] * 6, [1.0] * 6, (6, 6)),  # of 6: 0.031, below 0.05 at last
        ([2.0, 2.0, 2.0, 2.0, 2.0, 0.0, 1.0], [1.0] * 7, (5, 6)),  # 5 wins, a loss and a tie (left out: odd)
        ([2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0], [1.0] * 8, (7, 8)),  # two ties, one half to each side
        ([1.0] * 4, [1.0] * 4, (2, 4)),  # every block ties
    ],
)
def test_two_methods_are_compared_by_the_exact_sign_test_not_nemenyis_approximation(a, b, sign):
    from scipy.stats import binomtest

    found = ranking.rank_scores(["A", "B"], np.array([a, b]).T)
    expected = binomtest(*sign).pvalue  # Demšar 2006, 3.1.2: a tie counts half for each method, an odd one left out
    assert found.p_values["A"]["B"] == found.p_values["B"]["A"] == pytest.approx(expected)
    assert found.differ("A", "B") == (expected < 0.05)
    assert math.isnan(found.statistic) and math.isnan(found.critical_difference)
    assert bool(found.too_few_blocks()) == (len(a) < 6)  # 2 / 2 ** 5 = 0.0625: six blocks at least


def test_the_diagram_of_two_methods_names_the_test_that_drew_its_bars(tmp_path, monkeypatch):
    titles: list[str] = []
    monkeypatch.setattr(ranking, "critical_difference_png", lambda found, title: titles.append(title) or b"")
    board = _choose_board(tmp_path, {"lora": 85.0, "linear": 80.0}, seeds=6)
    report.critical_difference_png(board)
    assert titles[0].endswith("a bar joins methods the exact sign test cannot tell apart (α = 0.05)")


def test_a_consistent_order_over_enough_blocks_separates_the_ends():
    values = [[40.0, 30.0, 20.0, 10.0]] * 10  # ten blocks, one order: mean ranks 1, 2, 3, 4
    found = ranking.rank_scores(NAMES, values)
    # CD = 2.569 sqrt(20 / 60) = 1.48: neighbours cannot be told apart, two places apart can.
    assert found.groups == (("A", "B"), ("B", "C"), ("C", "D"))
    assert found.differ("A", "C") and not found.differ("A", "B")


def test_far_seeds_is_a_seed_more_than_ten_points_from_the_cells_median():
    assert ranking.far_seeds({0: 93.2, 1: 63.8, 2: 94.3}) == (1,)  # DoRA on mnist (DINOv2)
    assert ranking.far_seeds({0: 80.3, 1: 55.7, 2: 22.7}) == (0, 2)  # SSF on dsprites_loc: no two agree
    assert ranking.far_seeds({0: 72.8, 1: 62.0, 2: 68.3}) == ()  # a wide spread, no seed 10 points out
    assert ranking.far_seeds({0: 10.0, 1: 90.0}) == ()  # two seeds: no median to stand apart from


def _board_run(root: Path, task: str, method: str, seed: int, top1: float, val: list[float] | None = None) -> None:
    _write(root / task / method / f"seed{seed}", _result(task, method, seed, top1), val)


def test_the_legend_states_the_flag_rules_as_applied_to_two_seed_cells_and_seeds_own_curves(tmp_path):
    """Two seeds 60 points apart are not flagged ‡ (no median to stand apart from), and a board without a search
    flags ↑ on the mean change of the seeds' own curves: the legend says both, as the code applies them."""
    from petl.bench.notes import flag_lines

    curves = {0: [50.0, 60.0, 70.0, 80.0, 92.0], 1: [50.0, 60.0, 70.0, 80.0, 88.0]}  # +12 and +8: mean +10
    for seed in (0, 1):
        _board_run(tmp_path, "mini/digits", "lora", seed, 80.0 + seed, curves[seed])
        _board_run(tmp_path, "mini/digits", "linear", seed, 20.0 + 60.0 * seed)
    board = report.build_board(tmp_path)
    far, rising = flag_lines(board)[:2]
    assert far.startswith(
        "**‡**: a seed lies more than 10 points of test top-1 from the median of the cell's seeds (in a cell of three "
        "seeds or more; with three: from the middle one)"
    )
    assert far.endswith("0 cells.")
    assert rising.startswith(
        "**↑**: still learning, the cell's val top-1 rose by 10 points or more over the last 20% of the epochs (the "
        "curve of the search trial its finals were selected from, else the mean change of its seeds' own curves;"
    )
    assert rising.endswith("1 cell: lora digits (+10.0).")


def test_the_report_flags_cells_leaves_a_saturated_task_out_and_draws_the_diagram(tmp_path):
    tasks = ("mini/digits", "mini/mnist", "mini/clevr_count", "mini/textures")
    scores = {"lora": (90.0, 95.0, 70.0, 99.5), "linear": (80.0, 85.0, 40.0, 99.0), "mlp": (85.0, 90.0, 50.0, 100.0)}
    for method, per_task in scores.items():
        for task, top1 in zip(tasks, per_task, strict=True):
            for seed in (0, 1, 2):
                far = method == "mlp" and task == "mini/mnist" and seed == 2
                rising = [50.0, 60.0, 70.0, 80.0, 92.0] if method == "lora" and task == "mini/clevr_count" else None
                _board_run(tmp_path, task, method, seed, 60.0 if far else min(top1 + seed * 0.1, 100.0), rising)
    board = report.write_report(tmp_path)
    assert board.saturated == ["mini/textures"]
    found = board.ranking
    assert found.block == "task" and found.left_out_tasks == ("mini/textures",) and len(found.blocks) == 3
    assert found.methods == ("lora", "mlp", "linear")
    md = (tmp_path / "leaderboard.md").read_text()
    assert "| textures (saturated) |" in md
    assert "‡" in md and "1 cell: mlp mnist (seed 2: 90.0, 90.1, 60.0)." in md
    assert "1 cell: lora clevr_count (+12.0)." in md  # 92 - 80 over the last 20 % of 5 epochs
    assert "## Which differences are real" in md and "**Friedman's test**" in md and "critical_difference.png" in md
    rows = {r["experiment"]: r for r in _csv(tmp_path / "leaderboard.csv")}
    assert float(rows["lora"]["mean_rank"]) == 1.0 and rows["lora"]["rank_groups"] == "a"
    assert rows["mlp"]["mini/mnist_far_seeds"] == "2" and rows["lora"]["mini/textures_saturated"] == "1"
    png = (tmp_path / "critical_difference.png").read_bytes()
    assert png.startswith(b"\x89PNG") and b"tEXt" not in png  # no metadata (a date, a version) in the bytes
    assert 'alt="Which differences are real"' in (tmp_path / "leaderboard.html").read_text()


def _csv(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open() as f:
        return list(csv.DictReader(f))


def test_one_task_ranks_over_its_seeds_and_a_lone_row_is_not_tested(tmp_path):
    for method, top1 in (("lora", 80.0), ("linear", 70.0), ("mlp", 75.0)):
        for seed in (0, 1, 2):
            _board_run(tmp_path, "mini/digits", method, seed, top1 + seed)
    board = report.build_board(tmp_path)
    assert board.ranking.block == "seed" and board.ranking.blocks == ("seed 0", "seed 1", "seed 2")
    lone = tmp_path / "lone"
    _board_run(lone, "mini/digits", "lora", 0, 80.0)
    assert report.build_board(lone).ranking == "1 complete row: a comparison needs two"


def test_the_rank_correlation_carries_a_seeded_bootstrap_interval():
    measured = {m: float(i) for i, m in enumerate("abcdefgh")}
    published = {m: float(v) for m, v in zip("abcdefgh", [1, 0, 3, 2, 5, 4, 7, 6], strict=True)}
    found = rank_correlation(measured, published)
    low, high = found.interval
    assert low <= found.rho <= high and found.interval == rank_interval(
        [measured[m] for m in found.methods], [published[m] for m in found.methods]
    )
    assert "95 % bootstrap interval" in found.describe()
    assert math.isnan(rank_correlation({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 3, "c": 2}).interval[0])


def test_a_coefficient_over_too_few_rows_for_an_interval_says_so():
    # Over three rows rho was shown bare ("+0.50"), as firm as one with its interval.
    found = rank_correlation({"a": 3.0, "b": 2.0, "c": 1.0}, {"a": 3.0, "b": 1.0, "c": 2.0})
    assert found.describe() == "+0.50 (no bootstrap interval: 3 rows, it needs 4)"


def test_the_rank_interval_of_a_side_that_ties_every_method_is_nan_without_a_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "All-NaN slice" when no resample ranks anything
        assert all(map(math.isnan, rank_interval([1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 5.0, 5.0])))
        # Resamples that draw only the tied methods are left out; the others give the interval.
        low, high = rank_interval([1.0, 1.0, 1.0, 2.0], [1.0, 2.0, 3.0, 4.0])
    assert 0 < low <= high <= 1


def _choose_board(root: Path, means: dict[str, float], seeds: int) -> report.Leaderboard:
    for method, top1 in means.items():
        for seed in range(seeds):
            # The seeds move every method alike (seed s is a harder or easier draw), keeping the order per seed.
            _board_run(root, "mini/digits", method, seed, top1 + 3.0 * seed)
    return report.build_board(root)


def test_choose_says_when_the_best_two_cannot_be_told_apart_and_names_the_smaller(tmp_path):
    board = _choose_board(tmp_path, {"lora": 81.0, "linear": 80.0, "mlp": 70.0}, seeds=3)
    answer = choice.choose(board, choice.Budget())
    assert answer.best.experiment == "lora" and answer.runner_up.experiment == "linear"
    text = answer.paragraph
    assert "**lora** and **linear** cannot be told apart on this data" in text
    assert "each of the 3 seeds a block (one task)" in text and "p = " in text
    assert "is the smaller" in text and "seeds' spread" not in text


def test_choose_says_when_the_best_two_differ(tmp_path):
    board = _choose_board(tmp_path, {"lora": 85.0, "linear": 80.0}, seeds=6)
    text = choice.choose(board, choice.Budget()).paragraph
    said = "**lora** ranks above **linear** on this data (mean rank 1.00 against 2.00; the exact sign test, each of"
    assert said in text
    assert "p = 0.031 < 0.05" in text  # 2 / 2 ** 6


def test_choose_over_four_seeds_does_not_tell_two_methods_apart_that_no_exact_test_could(tmp_path):
    # Nemenyi's normal approximation put lora above linear after it won all 4 seeds (p = 0.046); the exact sign
    # test's p cannot go below 2 / 2 ** 4 = 0.125 there, nor can Wilcoxon's signed-rank test's.
    board = _choose_board(tmp_path, {"lora": 85.0, "linear": 80.0}, seeds=4)
    text = choice.choose(board, choice.Budget()).paragraph
    assert "**lora** and **linear** cannot be told apart on this data (the exact sign test, each of the 4 seeds" in text
    assert "p = 0.12; over 4 seeds no outcome could tell them apart: the sign test's p cannot go below 0.125" in text


def test_choose_says_when_the_test_favours_the_runner_up_over_the_best_mean(tmp_path):
    # The best row is picked by mean, the test runs on ranks: one seed far out gave lora the mean while linear ranked
    # first in 9 of 10 seeds, and the answer said "lora and linear differ" beside lora's name, as if lora had won.
    for seed in range(10):
        _board_run(tmp_path, "folder", "lora", seed, 100.0 if seed == 9 else 50.0)
        _board_run(tmp_path, "folder", "linear", seed, 51.0)
    answer = choice.choose(report.build_board(tmp_path), choice.Budget())
    assert answer.best.experiment == "lora" and answer.runner_up.experiment == "linear"
    text = answer.paragraph
    said = "**linear** ranks above **lora** on this data (mean rank 1.10 against 1.90; the exact sign test"
    assert said in text, text
    assert "though lora has the higher mean: the best by mean and the best by rank disagree" in text
    assert "differ on this data" not in text


def test_a_users_folder_board_names_no_groups_no_published_order_and_counts_one_task(tmp_path):
    for method, top1 in (("lora", 80.0), ("linear", 70.0), ("vpt_deep", 75.0)):
        _board_run(tmp_path, "folder", method, 0, top1)
    board = report.write_report(tmp_path)
    md = (tmp_path / "leaderboard.md").read_text()
    assert "1 task, 3 runs." in md and "over the 1 task of" in md and "1 tasks" not in md
    assert "groups —" not in md and "Rank correlation with the published" not in md
    mini = tmp_path / "mini"
    for method, top1 in (("lora", 80.0), ("linear", 70.0), ("vpt_deep", 75.0)):
        _board_run(mini, "mini/digits", method, 0, top1)
    report.write_report(mini)
    text = (mini / "leaderboard.md").read_text()
    assert "groups — natural: digits" in text and "Rank correlation with the published vtab1k" in text
    assert board.ranking is not None


def test_the_training_log_names_the_method_as_configured():
    from petl.train import config, runner

    cfg = config.compose_config(["method=adapter", "method.style=parallel", "method.dim=8", "data=mini/digits"])
    assert runner.method_label(cfg) == "adapter (style=parallel, dim=8)"
    assert runner.method_label(config.compose_config(["method=lora", "data=mini/digits"])) == "lora"


@pytest.mark.parametrize("suite", ["mini_dinov2", "mini_selection"])
def test_the_committed_comparison_sections_rebuild_from_the_committed_runs(suite):
    """Each committed board's comparison section (test, groups, mean ranks) is what its runs give today."""
    from petl.bench.notes import comparison_lines
    from petl.bench.table import markdown_lines, md_escape

    folder = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / suite
    board = report.build_board(folder / "runs", plan=report.plan_of(suite))
    committed = (folder / "leaderboard.md").read_text()
    for line in comparison_lines(board):
        assert f"- {md_escape(line)}" in committed
    assert "\n".join(markdown_lines(report.rank_table(board))) in committed
    assert (folder / "critical_difference.png").is_file()


def test_a_folder_runs_split_says_what_it_holds():
    from petl import data as petl_data
    from petl.data.folder import FOLDER_INFO
    from petl.store.result import RunResult
    from petl.train.runner import split_meaning

    held = split_meaning(FOLDER_INFO, petl_data.TRAIN, 30)
    assert held == "train800: the training images less val200 (the data's own validation split): 30 images"
    holdout = FOLDER_INFO.__class__(**{**FOLDER_INFO.__dict__, "val_from_train": "20% of each class, seed 0"})
    assert "less val200 (20% of each class, seed 0): 30 images" in split_meaning(holdout, petl_data.TRAIN, 30)
    assert split_meaning(FOLDER_INFO, petl_data.TRAIN_VAL, 36).startswith("train800val200: every training image")
    assert split_meaning(petl_data.get_info("mini/digits"), petl_data.TRAIN, 800) is None  # the name says it
    record = RunResult("lora", "folder", 0, split="train800", split_meaning=held)
    assert RunResult.from_json(record.to_json()).split_meaning == held
    assert "split_meaning" not in RunResult("lora", "mini/digits", 0).to_json()  # benchmark records unchanged


def test_the_diagram_is_the_same_bytes_in_every_process():
    """Same scores, same PNG: no date or version in it, and no drawing order taken from a set's hashing."""
    import os
    import subprocess
    import sys

    script = (
        "import sys; from petl.bench import ranking; "
        f"found = ranking.rank_scores({NAMES!r}, {[[40.0, 30.0, 20.0, 10.0]] * 10!r}); "
        "sys.stdout.buffer.write(ranking.critical_difference_png(found, 'four methods'))"
    )
    drawn = [
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    ]
    assert drawn[0].startswith(b"\x89PNG") and drawn[0] == drawn[1]


# A complete row on another backbone than the others' (two suites' runs in one folder, an experiment rerun with
# model=another): ranked with them, the test would compare backbones as much as methods.
OTHER = "vit_small_patch16_224"  # after the fractal ViT by name: the majority, not the name, picks the backbone


def _backbone_board(root: Path, models: dict[str, str]) -> report.Leaderboard:
    scores = {"lora": (90.0, 80.0), "linear": (70.0, 60.0), "mlp": (99.0, 95.0)}  # mlp first in every block
    for method, model in models.items():
        for task, top1 in zip(("mini/digits", "mini/mnist"), scores[method], strict=True):
            for seed in (0, 1):
                _write(root / task / method / f"seed{seed}", _result(task, method, seed, top1 + seed, model=model))
    return report.write_report(root)


def test_a_complete_row_on_another_backbone_is_not_ranked_and_is_named(tmp_path):
    from petl.bench import compare, notes

    fractal = "vit_fractal_tiny_patch4_32.fractaldb"
    board = _backbone_board(tmp_path, {"lora": OTHER, "linear": OTHER, "mlp": fractal})
    mlp = next(r for r in board.rows if r.experiment == "mlp")
    assert board.ranked_backbone == OTHER and board.other_backbone(mlp) and not board.complete(mlp)
    assert board.ranking.methods == ("lora", "linear")
    assert set(compare.placings(board)) == {"lora", "linear"}  # compare's ordering, and the published one's
    assert notes.published_ranking(board).methods == ("lora", "linear")
    md = (tmp_path / "leaderboard.md").read_text()
    assert "| mlp * |" in md and "Other backbone** below" in md
    assert (
        f"**Other backbone**: 1 row ran every task on another backbone than the {OTHER} of the ranked rows (the "
        "backbone the most complete rows ran; a tie goes to the first by name), so the rank test, which compares "
        f"methods on one model, leaves it out; marked `*`, not ranked (report each backbone's runs apart): "
        f"mlp ({fractal})." in md
    )
    assert f"Not ranked, marked `*` in the table: mlp (on {fractal})." in md
    # A suite's progress names it apart from the rows short of a task or seed.
    plan = report.Plan("mini", ("lora", "linear", "mlp"), ("mini/digits", "mini/mnist"), (0, 1))
    line = notes.progress(report.build_board(tmp_path, plan=plan))
    assert "Complete rows (2): lora, linear." in line and "Short of a task" not in line
    assert f"On another backbone than {OTHER}, marked `*` and not ranked (1): mlp." in line
    # A tie of complete rows goes to the first backbone by name.
    tie = _backbone_board(tmp_path / "tie", {"lora": OTHER, "mlp": fractal})
    assert tie.ranked_backbone == fractal and [r.experiment for r in tie.rows if tie.complete(r)] == ["mlp"]


def test_rows_on_one_backbone_are_all_ranked_and_nothing_is_said_of_backbones(tmp_path):
    board = _backbone_board(tmp_path, {"lora": OTHER, "linear": OTHER, "mlp": OTHER})
    assert board.ranking.methods == ("mlp", "lora", "linear")
    assert not any(board.other_backbone(r) for r in board.rows)
    assert "**Other backbone**" not in (tmp_path / "leaderboard.md").read_text()


def test_a_p_that_underflowed_to_zero_is_said_as_below_1e_300_not_as_0(tmp_path):
    import dataclasses

    from petl.bench.notes import comparison_lines

    # 27 methods in one order over 60 tasks: Friedman's p is below the smallest double, and scipy gives 0.0.
    names = [f"m{i}" for i in range(27)]
    assert ranking.rank_scores(names, np.tile(np.arange(27.0, 0.0, -1.0), (60, 1))).p_value == 0.0
    board = _choose_board(tmp_path, {"lora": 85.0, "linear": 80.0, "mlp": 70.0}, seeds=3)
    board.ranking = dataclasses.replace(board.ranking, p_value=0.0)
    section = " ".join(comparison_lines(board))
    assert "chi-square = 6.00, p < 1e-300: at α = 0.05" in section and "p = 0:" not in section
    rows = {row.experiment: row for row in board.rows}
    verdict, _ = choice._verdict(board.ranking, rows["lora"], rows["mlp"], "mini/digits")
    assert "after Friedman's test over the 3 rows (p < 1e-300)" in verdict and "(p = 0)" not in verdict, verdict
    assert verdict.endswith(": p = 0.038 < 0.05)"), verdict  # Nemenyi's p, said with alpha


def test_a_nemenyi_p_that_underflowed_to_zero_reads_as_below_1e_300_alone(tmp_path):
    import dataclasses

    board = _choose_board(tmp_path, {"lora": 85.0, "linear": 80.0, "mlp": 70.0}, seeds=3)
    p_values = {a: dict(row) for a, row in board.ranking.p_values.items()}
    p_values["lora"]["mlp"] = p_values["mlp"]["lora"] = 0.0
    found = dataclasses.replace(board.ranking, p_values=p_values)
    rows = {row.experiment: row for row in board.rows}
    verdict, _ = choice._verdict(found, rows["lora"], rows["mlp"], "mini/digits")
    # It said "p < 1e-300 < 0.05".
    assert verdict.endswith(": p < 1e-300)"), verdict


def test_the_ranked_backbone_is_found_once_a_board_not_once_a_row(tmp_path, monkeypatch):
    # Was: found again from every row each time a row asked (complete(), the table's marks, the legend), so a board's
    # build read every row once per row asking: half of build_board on 30 experiments x 7 tasks x 3 seeds.
    from petl.bench.board import Leaderboard
    from petl.bench.notes import notes
    from petl.bench.report import display_table

    methods = [f"m{i:02d}" for i in range(12)]
    for i, method in enumerate(methods):
        for task in ("mini/digits", "mini/mnist"):
            _write(tmp_path / task / method / "seed0", _result(task, method, 0, 50.0 + i))
    asked = []
    backbones = Leaderboard.backbones
    monkeypatch.setattr(Leaderboard, "backbones", lambda board, row: asked.append(row) or backbones(board, row))
    board = report.build_board(tmp_path)
    notes(board), display_table(board)
    assert len(board.rows) == 12 and all(map(board.complete, board.rows))
    # Each question about a row reads that row's backbones (twice: mixed, other_backbone), and a board asks about
    # each row some ten times: 216 reads here, where finding the ranked backbone again each time read 2496.
    assert len(asked) <= 24 * len(board.rows)
    # Found again when the rows change.
    board.rows[:] = [r for r in board.rows if r.experiment == "m00"]
    assert board.ranked_backbone == "vit_fractal_tiny_patch4_32.fractaldb"


def test_a_difference_of_exactly_the_threshold_is_read_alike_whatever_its_last_bit():
    from petl.bench.board import TaskScore
    from petl.bench.columns import still_learning
    from petl.bench.ranking import FAR_SEED_POINTS, RISING_POINTS, far_seeds

    # Both cells have a seed exactly 10 points from the middle one, which is not "more than 10": 19.1 - 9.1 is
    # 10.000000000000002 in floating point and was flagged, 80.6 - 70.6 is 10.0 and was not.
    assert FAR_SEED_POINTS == 10.0
    assert far_seeds({0: 9.1, 1: 19.1, 2: 19.5}) == () and far_seeds({0: 70.6, 1: 80.6, 2: 81.0}) == ()
    assert far_seeds({0: 9.0, 1: 19.1, 2: 19.5}) == (0,)
    # A rise of 3 of 30 val images is 10 points, "10 or more": 100 * 7 / 30 - 100 * 4 / 30 is 9.999999999999998.
    assert RISING_POINTS == 10.0
    assert still_learning(TaskScore(50.0, 1.0, (0,), tail_change=100 * 7 / 30 - 100 * 4 / 30))
    assert not still_learning(TaskScore(50.0, 1.0, (0,), tail_change=100 * 6 / 30 - 100 * 4 / 30))


def test_the_published_ordering_is_compared_with_means_tied_as_the_rank_test_ties_them():
    import types

    from petl.bench.notes import published_ranking

    # gps and ssf got the same hits, summed in another order (80.6 + 82.8 + 83.0 and 83.4 + 81.6 + 81.4): one mean,
    # whose last bit ranked ssf above gps and made rho 0.80 where, tied, it is 0.95.
    means = {"gps": (80.6 + 82.8 + 83.0) / 3, "ssf": (83.4 + 81.6 + 81.4) / 3, "lora": 80.0, "bitfit": 70.0}
    assert means["gps"] != means["ssf"]
    rows = [types.SimpleNamespace(experiment=name, task_mean=mean) for name, mean in means.items()]
    names = {"gps": "GPS", "ssf": "SSF", "lora": "LoRA", "bitfit": "BitFit"}
    board = types.SimpleNamespace(rows=rows, published_names=names, complete=lambda row: True)
    assert published_ranking(board).rho == pytest.approx(0.9486832980505138)  # scipy's rho with gps and ssf tied
