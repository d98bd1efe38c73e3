"""The leaderboard's sentences: notes under the table, progress, the ranking against the published table."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

from petl.bench import ranking
from petl.bench.board import (
    DIFFERENT_BACKBONE,
    NO_PUBLISHED_ROW,
    ExperimentRow,
    Leaderboard,
)
from petl.bench.collect import (
    set_aside_files,
)
from petl.bench.columns import (
    FAR_SEED_MARK,
    MORE_SEEDS_MARK,
    NOT_IN_SUITE_MARK,
    RISING_MARK,
    SATURATED_MARK,
    still_learning,
    task_labels,
)
from petl.bench.curves import CONVERGENCE_TAIL
from petl.bench.published import (
    MIN_RANKED,
    TABLES,
    PublishedTable,
    RankCorrelation,
    rank_correlation,
    table_for,
)
from petl.bench.table import md_name
from petl.store.result import ResultError, read_result
from petl.utils.text import plural, shown


def notes(board: Leaderboard) -> list[str]:
    """The legend every rendering carries: what each summary column means and where published figures come from."""
    counted = board.counted_tasks
    members = {g: [t.rsplit("/", 1)[-1] for t in counted if board.groups[t] == g] for g in board.group_names}
    group_text = "; ".join(f"{g}: {', '.join(names)}" for g, names in members.items() if names)
    # A user's own data (a folder, a saved dataset) belongs to no benchmark group: its registry entry's group is a
    # default, not a finding.
    groups = (
        f" **Group mean** = mean of the group averages (as VPT, NOAH and Adapter+ report), groups — {group_text}."
        if benchmark_tasks(board)
        else ""
    )
    # Why a row is marked beyond a task or seed it lacks, each said in a line of its own below.
    marks = []
    if any(map(board.mixed, board.rows)):
        marks.append("its tasks ran on different backbones: **Mixed backbones** below")
    if any(map(board.other_backbone, board.rows)):
        marks.append("it ran on another backbone than the ranked rows: **Other backbone** below")
    lines = [
        f"Measured by petl on {', '.join(board.models)}; top-1 test accuracy (%) as mean ± sample standard "
        "deviation over seeds (no ± with one seed).",
        f"**Task mean** = unweighted mean over the {plural(len(board.counted_tasks), 'task')} of the per-task means "
        f"(V-PETL's `task_mean`).{groups}",
        "**PPT** = M·exp(−log10(P/C + 1)), M = task mean as a fraction, P = trainable parameters without the "
        "head (mean over runs), C = 10^7 (V-PETL Bench).",
        "Trainable counts are means over runs (the head's size follows each task's classes); % is of all "
        "parameters. Train s/run and Images/s are means over runs (as the engine ran them, feature caching "
        "included, the test pass not); Peak MB is the maximum over runs"
        + (f" ({', '.join(board.memory_kinds)})." if board.memory_kinds else "."),
        "`*` after an experiment: it has not run on every task, or with every seed"
        + (f" (as many as most cells have, {board.seed_count})" if board.plan is None else "")
        + ", yet, so its means cover fewer tasks or seeds"
        + (f" (or {'; or '.join(marks)})." if marks else "."),
    ]
    lines += [
        line
        for line in (
            not_learned_line(board),
            more_seeds_line(board),
            *flag_lines(board),
            set_aside_line(board),
            mixed_line(board),
            other_line(board),
        )
        if line
    ]
    outside = [t for t in board.tasks if t not in board.counted_tasks]
    if outside:
        lines.append(
            f"**{NOT_IN_SUITE_MARK}**: {', '.join(name_labels(board.tasks)[t] for t in outside)}, not a task of suite "
            f"`{board.plan.suite if board.plan else ''}`: its runs are shown, and left out of every mean, of the "
            "rank test and of the row's cost columns (parameters, train seconds, memory), so that each row's figures "
            "cover the suite's tasks."
        )
    if board.plan is not None:
        lines.append(progress(board))
    if board.compute is not None:
        lines.append(board.compute.line())
    if board.skipped:
        n = len(board.skipped)
        # A folder name of bytes that are not UTF-8 (one reason to skip a file) is named by its escapes: the pages are
        # UTF-8.
        names = ", ".join(shown(p.relative_to(board.results_dir)) for p in board.skipped)
        lines.append(
            f"**Skipped**: {n} result.json {'files were' if n > 1 else 'file was'} skipped as damaged or incomplete "
            f"(a field missing or malformed; each named in a warning when this report was built): {names}."
        )
    lines += [c.note for c in board.columns if c.note]
    if board.published_names and benchmark_tasks(board):
        lines.append(ranking_line(board))
    for table in board.tables:
        # The tasks the measured task mean covers: with a suite, not a task outside it (in no mean).
        ran = len({table.column(t) for t in board.counted_tasks if table.covers(t)} & set(table.columns()))
        partial = (
            f" Its task mean, group mean and PPT are the published ones, over its {len(table.columns())} tasks, of "
            f"which this board ran {ran}: they do not compare with the measured task mean, the per-task figures do."
            if table.over_its_tasks(board.counted_tasks)
            else ""
        )
        lines.append(
            f"**Published {table.key}** columns: {table.title}; source: {table.source}. Figures published by "
            "others, not measured by petl; they are never mixed into the measured columns. They are shown only "
            f"beside experiments run on the published backbone (`{table.backbone}`, pretrained): otherwise the "
            f'row column says "{DIFFERENT_BACKBONE}"; "{NO_PUBLISHED_ROW}" means the experiment file names no '
            f"row of this table (`published:`).{partial}"
        )
    return lines


def name_labels(tasks: list[str]) -> dict[str, str]:
    """:func:`petl.bench.columns.task_labels`, each escaped for a Markdown sentence (:func:`md_name`)."""
    return {t: md_name(label) for t, label in task_labels(tasks).items()}


def benchmark_tasks(board: Leaderboard) -> bool:
    """Whether every task the board's means count (:attr:`~petl.bench.board.Leaderboard.counted_tasks`) is a
    benchmark's, none a user's own data or a name petl does not know; a task outside the suite, in no mean, is not
    asked.

    A benchmark's task: one petl's dataset registry holds that does not read the user's files (``mini/digits``,
    ``vtab/cifar100``), or one a published table covers by its prefix (``fgvc/...``, registered by a plugin in the
    process that trained).  Only then is the board's order compared with a published one, and its tasks' groups
    named: a name the registry does not know (``my data``, a folder's) has no benchmark group, and no published
    figure stands for it.
    """
    from petl.bench.own_data import is_own_data

    def benchmark(task: str) -> bool:
        try:
            return not is_own_data(task)
        except (KeyError, ValueError):
            return table_for(task) is not None  # unknown here: a benchmark's only if a published table has it

    return all(benchmark(t) for t in board.counted_tasks)


def flag_lines(board: Leaderboard) -> list[str]:
    """The legend's lines on the cells marked ‡ (a seed far from the others) and ↑ (still learning), and on the
    saturated tasks; each states its rule and counts what it marks.
    """
    labels = name_labels(board.tasks)
    far = [
        f"{md_name(row.experiment)} {labels[t]} (seed {', '.join(map(str, s.far_seeds))}: "
        + ", ".join(f"{v:.1f}" for _, v in sorted(ranking.seed_scores(row, t).items()))
        + ")"
        for row in board.rows
        for t, s in row.scores.items()
        if s.far_seeds
    ]
    rising = [
        f"{md_name(row.experiment)} {labels[t]} ({s.tail_change:+.1f})"
        for row in board.rows
        for t, s in row.scores.items()
        if still_learning(s)
    ]
    tail = f"{CONVERGENCE_TAIL:.0%}"
    lines = [
        f"**{FAR_SEED_MARK}**: a seed lies more than {ranking.FAR_SEED_POINTS:g} points of test top-1 from the median "
        "of the cell's seeds (in a cell of three seeds or more; with three: from the middle one), so the cell's mean "
        f"stands between two outcomes; the mean keeps every seed. {plural(len(far), 'cell')}"
        + (f": {'; '.join(far)}." if far else "."),
        f"**{RISING_MARK}**: still learning, the cell's val top-1 rose by {ranking.RISING_POINTS:g} points or more "
        f"over the last {tail} of the epochs (the curve of the search trial its finals were selected from, else the "
        "mean change of its seeds' own curves; the CSV's `TASK_val_tail_change`; about twice the noise of two val200 "
        "accuracies): a longer schedule may move the cell. "
        f"{plural(len(rising), 'cell')}" + (f": {'; '.join(rising)}." if rising else "."),
    ]
    if board.saturated:
        names = ", ".join(labels[t] for t in board.saturated)
        lines.append(
            f"**{SATURATED_MARK}**: every complete row scores within {ranking.SATURATED_POINTS:g} points of 100 % "
            f"on {names}; the methods differ there by a few test images, so the rank test leaves "
            f"{'it' if len(board.saturated) == 1 else 'them'} out. The table and the means keep "
            f"{'it' if len(board.saturated) == 1 else 'them'}."
        )
    return lines


def not_learned_line(board: Leaderboard) -> str:
    """The legend's line on the cells with a seed that did not learn (``""`` when every run learned)."""
    labels = name_labels(board.tasks)
    cells = [
        f"{md_name(row.experiment)} {labels[task]} (seed {', '.join(map(str, score.not_learned))})"
        for row in board.rows
        for task, score in row.scores.items()
        if score.not_learned
    ]
    if not cells:
        return ""
    return (
        f"**† k**: k of the cell's seeds did not learn (final train loss not finite, not below its first "
        f"epoch's, or at chance: ln(classes), or the entropy of its labels' shares in records that hold it, or the "
        f"last epoch's train top-1 not above chance, the share of its most "
        f"frequent label (1/classes in records that predate that count): "
        f"`petl.train.learning`); the cell's mean and ± include them, so a "
        f"finding must not rest on such a cell. {plural(len(cells), 'cell')}: {'; '.join(cells)}."
    )


def more_seeds_line(board: Leaderboard) -> str:
    """The legend's line on the cells marked ⁺, with more seeds than the board's cells need (``""`` when none has).

    Without a suite such a cell's figures are over all its seeds; with one, the runs of seeds outside it are left
    out, as a task outside it is.
    """
    labels = name_labels(board.tasks)
    plan = board.plan
    if plan is None:
        cells = [
            f"{md_name(row.experiment)} {labels[t]} (seeds {', '.join(map(str, s.seeds))})"
            for row in board.rows
            for t, s in row.scores.items()
            if board.more_seeds(s)
        ]
        rule = (
            f"the cell ran more seeds than the {plural(board.seed_count, 'seed')} most cells have (a row is "
            "complete with every task at that count or more); its mean and ± are over all its seeds, more than the "
            "other cells'"
        )
    else:
        # From the runs, not the scores: a task run only with seeds outside the suite has none (its cell shows – ⁺).
        outside = {(row.experiment, t): board.outside_seeds(row, t) for row in board.rows for t in board.tasks}
        cells = [
            f"{md_name(e)} {labels[t]} (seed {', '.join(map(str, seeds))})"
            for (e, t), seeds in outside.items()
            if seeds
        ]
        rule = (
            f"the cell has runs of seeds outside suite `{plan.suite}` (seeds {', '.join(map(str, plan.seeds))}): "
            "they are left out of its mean, ±, the rank test, its val curves and the row's cost columns (parameters, "
            "train seconds, memory), so that every cell is over the suite's seeds"
        )
    if not cells:
        return ""
    return f"**{MORE_SEEDS_MARK}**: {rule}. {plural(len(cells), 'cell')}: {'; '.join(cells)}."


def mixed_line(board: Leaderboard) -> str:
    """The legend's line on the rows whose tasks ran on different backbones (``""`` when there are none)."""
    labels = name_labels(board.tasks)
    rows = [
        f"{md_name(row.experiment)} ("
        + "; ".join(f"{name}: {', '.join(labels[t] for t in tasks)}" for name, tasks in board.backbones(row).items())
        + ")"
        for row in board.rows
        if board.mixed(row)
    ]
    if not rows:
        return ""
    return (
        f"**Mixed backbones**: the tasks of {plural(len(rows), 'row')} ran on different backbones, so "
        f"{'its task mean averages' if len(rows) == 1 else 'their task means average'} different models and "
        "compares with no other row's; marked `*`, not ranked (report each backbone's runs apart, or run every "
        f"task on one backbone): {'; '.join(rows)}."
    )


def other_line(board: Leaderboard) -> str:
    """The legend's line on the rows on another backbone than the ranked rows' (``""`` when there are none)."""
    rows = [
        f"{md_name(row.experiment)} ({next(iter(board.backbones(row)))})"
        for row in board.rows
        if board.other_backbone(row)
    ]
    if not rows:
        return ""
    return (
        f"**Other backbone**: {plural(len(rows), 'row')} ran every task on another backbone than the "
        f"{board.ranked_backbone} of the ranked rows (the backbone the most complete rows ran; a tie goes to the first "
        "by name), so the rank test, which compares methods on one model, leaves "
        f"{'it' if len(rows) == 1 else 'them'} out; marked `*`, not ranked (report each backbone's runs apart): "
        f"{'; '.join(rows)}."
    )


def set_aside_line(board: Leaderboard) -> str:
    """The legend's line on the finals ``require_learning`` set aside (``""`` when there are none)."""
    paths = set_aside_files(board.results_dir)
    if not paths:
        return ""
    cells: dict[str, list[str]] = {}
    seconds = 0.0
    for path in paths:
        # <task folder>/<experiment>/unstable/<point>/seed<k>/result.json; the task is the record's (a folder
        # name is mini-digits, or mini/digits in results written before the one-level layout).
        run, point, experiment = path.parent, path.parent.parent.name, path.parents[3].name
        try:
            result = read_result(path)
        except ResultError as error:  # counted by its folder; the leaderboard never reads it
            warnings.warn(f"set-aside run: {error}", stacklevel=2)
            result = None
        task = result.dataset if result else path.parents[4].relative_to(board.results_dir).as_posix()
        cells.setdefault(f"{md_name(experiment)} {md_name(task.rsplit('/', 1)[-1])} at {point}", []).append(run.name)
        seconds += float(result.wall_seconds or 0.0) if result else 0.0
    listed = "; ".join(f"{cell} ({', '.join(runs)})" for cell, runs in sorted(cells.items()))
    return (
        f"**Set aside**: {len(paths)} final runs trained at a point where training did not learn, moved into "
        "an `unstable` folder beside the cell's seed folders by the suite's `require_learning` rule and replaced "
        f"by the next point's finals; not in the table, {seconds / 3600:.2f} h of run time: {listed}."
    )


def progress(board: Leaderboard, name: Callable[[str], str] = md_name) -> str:
    """How far the board's suite got: its complete rows, the rows short of a task or seed, those not started.

    Empty without a plan.

    Args:
        board: the leaderboard.
        name: how an experiment name is set: escaped for Markdown (default), ``str`` for the console.
    """
    plan = board.plan
    if plan is None:
        return ""
    rows = {row.experiment: row for row in board.rows}
    total = len(plan.tasks) * len(plan.seeds)

    def runs_done(row: ExperimentRow) -> int:
        return sum(len(set(row.scores[t].seeds) & set(plan.seeds)) for t in plan.tasks if t in row.scores)

    complete = [e for e in plan.experiments if e in rows and board.complete(rows[e])]
    mixed = [e for e in plan.experiments if e in rows and board.mixed(rows[e])]
    other = [e for e in plan.experiments if e in rows and board.other_backbone(rows[e])]
    partial = [
        f"{name(e)} ({runs_done(rows[e])} of {total})"
        for e in plan.experiments
        if e in rows and e not in complete and e not in mixed and e not in other
    ]
    missing = [e for e in plan.experiments if e not in rows]
    done = sum(runs_done(rows[e]) for e in plan.experiments if e in rows)
    parts = [
        f"**Progress** of suite `{plan.suite}` ({plural(len(plan.experiments), 'experiment')} x "
        f"{plural(len(plan.tasks), 'task')} x {plural(len(plan.seeds), 'seed')} = {len(plan.experiments) * total} "
        f"final runs): {done} finished.",
        f"Complete rows ({len(complete)}): {', '.join(map(name, complete)) or 'none yet'}.",
    ]
    if partial:
        parts.append(
            f"Short of a task or seed, marked `*` and ranked after the complete rows, final runs finished: "
            f"{', '.join(partial)}."
        )
    if mixed:
        parts.append(
            f"On different backbones, marked `*` and not ranked ({len(mixed)}): {', '.join(map(name, mixed))}."
        )
    if other:
        parts.append(
            f"On another backbone than {board.ranked_backbone}, marked `*` and not ranked ({len(other)}): "
            f"{', '.join(map(name, other))}."
        )
    if missing:
        parts.append(f"No final run yet ({len(missing)}; searching or not started): {', '.join(map(name, missing))}.")
    outside = [row.experiment for row in board.rows if row.experiment not in plan.experiments]
    if outside:
        parts.append(f"Not in the suite, marked `*` and not ranked ({len(outside)}): {', '.join(map(name, outside))}.")
    return " ".join(parts)


# The published ordering the leaderboard's is compared with: V-PETL's VTAB-1k table (19 tasks, 224 px).
RANKED_TABLE = next(t for t in TABLES if t.key == "vtab1k")


def published_ranking(board: Leaderboard, table: PublishedTable = RANKED_TABLE) -> RankCorrelation:
    """Spearman's rho between the task means of the board's complete rows and their published rows' task means.

    Only complete rows count (a mean over fewer tasks or seeds is not ranked), and only those whose
    experiment file names a row of ``table`` (``published:``).  The methods are named by experiment.
    """
    rows = table.rows()
    pairs = {}
    for row in board.rows:
        pub = rows.get(board.published_names.get(row.experiment, ""))
        if pub is not None and board.complete(row):
            # At the rank test's precision (score_key): means of the same hits summed in another order tie.
            pairs[row.experiment] = (ranking.score_key(row.task_mean), pub.task_mean)
    return rank_correlation({e: m for e, (m, _) in pairs.items()}, {e: p for e, (_, p) in pairs.items()})


def ranking_line(board: Leaderboard, table: PublishedTable = RANKED_TABLE, name: Callable[[str], str] = md_name) -> str:
    """The legend's line on :func:`published_ranking`, with its caveat.

    Args:
        board: the leaderboard.
        table: the published table whose ordering is compared.
        name: how an experiment name is set: escaped for Markdown (default), ``str`` for the console.
    """
    found = published_ranking(board, table)
    methods = ", ".join(map(name, found.methods)) or "none"
    head = f"**Rank correlation with the published {table.key} ordering**: "
    if math.isnan(found.rho) and len(found.methods) >= MIN_RANKED:
        # Enough rows, but one side ranks them all equal: there is no ordering to compare.
        measured = {row.experiment: row.task_mean for row in board.rows}
        if len({measured[m] for m in found.methods}) == 1:
            tie = f"all tie here, at a task mean of {measured[found.methods[0]]:.2f}"
        else:
            tie = "have published task means that all tie"
        body = (
            f"not computed: the {len(found.methods)} complete rows that name a published row ({methods}) {tie}, "
            "so there is no ordering to compare."
        )
    elif math.isnan(found.rho):
        body = (
            f"not computed: {len(found.methods)} complete row(s) name a published row ({methods}); "
            f"it needs {MIN_RANKED} that do not all tie."
        )
    else:
        body = (
            f"Spearman's rho = {found.describe()} between the task means of the {len(found.methods)} complete rows "
            f"that name a published row ({methods}) and those rows' published task means."
        )
    return (
        head
        + body
        + f" Published: {table.title}; source: {table.source} (supervised), on its own tasks at {table.img_size} px; "
        f"measured here: {board.ranked_backbone or ', '.join(board.models)} on "
        + ("this task. " if len(board.counted_tasks) == 1 else f"these {len(board.counted_tasks)} tasks. ")
        + "Other backbone, tasks and recipe: it compares the methods' orderings, not their accuracies."
    )


def unranked(board: Leaderboard) -> str:
    """`` Not ranked: a (short of a task or seed), b (not in the suite).`` for the rows the rank test leaves out (a row
    on different backbones: ``c (on A, B)``; on another backbone than the ranked rows': ``d (on B)``).

    A row short of a task or seed (a failed run, a sweep not finished) may be the best on the board; the groups and
    mean ranks say nothing of it, and the section says so rather than leave the reader to find its `*`.
    """
    outside = set() if board.plan is None else {r.experiment for r in board.rows} - set(board.plan.experiments)

    def why(row: ExperimentRow) -> str:
        if row.experiment in outside:
            return "not in the suite"
        if board.mixed(row) or board.other_backbone(row):
            return f"on {', '.join(board.backbones(row))}"
        return "short of a task or seed"

    left = [f"{md_name(row.experiment)} ({why(row)})" for row in board.rows if not board.complete(row)]
    return f" Not ranked, marked `*` in the table: {', '.join(left)}." if left else ""


COMPARISON_TITLE = "Which differences are real"
CD_FILE = "critical_difference.png"


def comparison_lines(board: Leaderboard) -> list[str]:
    """The comparison section's sentences: the blocks, Friedman's test, Nemenyi's (of two methods, the exact sign
    test), the groups (Markdown).
    """
    found = board.ranking
    if not isinstance(found, ranking.Ranking):
        return [(f"Not tested: {found}." if found else "Not tested.") + unranked(board)]
    labels = name_labels(board.tasks)
    k, n = len(found.methods), len(found.blocks)
    if found.block == "task":
        left = ", ".join(labels[t] for t in found.left_out_tasks)
        block = (
            f"**Blocks**: the {plural(n, 'task')} ({', '.join(labels[t] for t in found.blocks)}), each cell the mean "
            "of its seeds" + (f"; {left} left out as saturated" if left else "") + ". A claim that one method beats "
            "another is a claim across tasks, and the seeds of one task share its data: as blocks they would count "
            "one task once per seed."
        )
    else:
        # The one task may be the one left of several, the others saturated: name both, as the task blocks do.
        left = ", ".join(labels[t] for t in found.left_out_tasks)
        block = (
            f"**Blocks**: the {plural(n, 'seed')} of the one task, {labels.get(found.task, found.task)} (task × seed)"
            + (f"; {left} left out as saturated" if left else "")
            + ". With one task the seeds are the only blocks there are, so what follows is about this data, not "
            "about data like it."
        )
    lines = [
        block + f" Ranked: the {plural(k, 'complete row')} (rank 1 = the best accuracy in a block, ties share "
        "their mean rank)." + unranked(board),
    ]
    if k < 3:
        lines.append("**Friedman's test** needs three methods; with two, the exact sign test below decides alone.")
    elif math.isnan(found.p_value):
        lines.append(
            f"**Friedman's test** (`scipy.stats.friedmanchisquare`) over {k} methods and {plural(n, 'block')}: every "
            "block ties every method, so there is no statistic and it does not reject that every method ranks "
            "alike; no pair below is declared different."
        )
    else:
        verdict = (
            "the methods do not all rank alike"
            if found.omnibus_rejects
            else "it does not reject that every method ranks alike, so no pair below is declared different"
        )
        lines.append(
            f"**Friedman's test** (`scipy.stats.friedmanchisquare`) over {k} methods and {plural(n, 'block')}: "
            f"chi-square = {found.statistic:.2f}, {ranking.said_p(found.p_value, found.alpha)}: "
            f"at α = {found.alpha:g}, {verdict}."
        )
    pairs = [(a, b) for i, a in enumerate(found.methods) for b in found.methods[i + 1 :]]
    differ = sum(found.differ(a, b) for a, b in pairs)
    # Friedman's test can keep a pair whose gap passes the critical difference (Nemenyi's test is not nested in it):
    # the rank table shows that gap, so the sentence says why it is not a difference.
    wide = sum(found.p_values[a][b] < found.alpha for a, b in pairs) if not found.omnibus_rejects else 0
    kept = (
        f" ({plural(wide, 'pair lies', 'pairs lie')} that far apart, but Friedman's test above does not reject, so "
        f"{'it is' if wide == 1 else 'they are'} not declared different)"
        if wide
        else ""
    )
    if k < 3:
        a, b = found.methods
        lines.append(
            "**The exact sign test** (`scipy.stats.binomtest` on the blocks each method wins, a tie counted half to "
            "each, an odd one left out; Demšar, JMLR 2006, section 3.1.2; Nemenyi's test of two methods is its normal "
            f"approximation, which errs over few blocks): {ranking.said_p(found.p_values[a][b], found.alpha)}: at α = "
            f"{found.alpha:g}, {'they differ' if differ else 'they cannot be told apart'}."
        )
    else:
        lines.append(
            f"**Nemenyi's post-hoc test** (`scikit_posthocs.posthoc_nemenyi_friedman`, family-wise α = {found.alpha:g};"
            f" Demšar, JMLR 2006): two methods differ when their mean ranks lie more than "
            f"{found.critical_difference:.2f} apart (the critical difference); {differ} of the {len(pairs)} pairs "
            f"do{kept}."
        )
    few = found.too_few_blocks()
    if few:
        more = "the methods with more seeds" if found.block == "seed" else "the methods on more tasks"
        lines.append(
            f"**Too few blocks**: over {plural(n, found.block)} no outcome could tell two methods apart: {few}. "
            f"That no pair differs below is a count of blocks, not a finding, and the intervals rest on {n} blocks; "
            f"run {more}."
        )
    groups = "; ".join(f"{ranking.letter(i)}: {', '.join(map(md_name, g))}" for i, g in enumerate(found.groups))
    lines.append(
        f"**Groups** (methods no two of which can be told apart, in mean-rank order; the bars of `{CD_FILE}`): "
        f"{groups}. Two methods that share a letter cannot be told apart at this level."
    )
    if n < 2:  # no spread to measure: the table shows –
        lines.append("**Mean rank interval**: none over one block.")
    else:
        floor = ranking.rank_floor(n)
        lines.append(
            f"**Mean rank interval**: 95 % Student t interval over the {plural(n, 'block')}: the mean rank ± "
            f"t({n - 1}) · sd / √{n} of the method's ranks in the blocks (`scipy.stats.t`), at least ± {floor:.2f} "
            f"and clipped to 1 and {k}. The floor is for a method that took the same rank in all {n} blocks (no sd): "
            f"it may yet take another in up to {floor * 100:.0f} % of blocks (the exact binomial bound after 0 of {n}, "
            f"`scipy.stats.binomtest`), which moves its mean rank {floor:.2f} if to the next rank, further if "
            "further; an interval at the floor is that bound, not a measured spread."
        )
    return lines
