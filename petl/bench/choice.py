"""The answer to "which method for my data": one paragraph read off the leaderboard of a results folder.

Among the leaderboard's complete rows (every seed finished) within the user's budget (``budget.params=``: trainable
parameters, head included, what a task stores; ``budget.train_seconds=``: the final runs' mean training time as
recorded, on the machine that trained them), the best test top-1 mean is named with the runner-up, the gap between
them and whether the rank test tells them apart (:func:`petl.bench.ranking.rank_test` over the rows within the
budget: Friedman's test, then Nemenyi's, or with two rows the exact sign test; with the one task of a user's data,
each seed is a block), and the commands that use the chosen run: the best row's, or the runner-up's where the test
cannot tell the two apart and it trains fewer parameters (its lowest seed's folder whose training learned: chosen
before looking at the seeds' test numbers).  The methods the answer could not weigh are named next to it: rows short
of a seed (a failed or unfinished run) and the suite's experiments with no finished run at all.
``choice.md`` in the results folder holds the paragraph and the cost before the run against the real one.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petl.bench.board import ExperimentRow, Leaderboard
from petl.bench.estimate import duration
from petl.bench.ranking import Ranking, rank_test, said_p, score_key
from petl.store.files import write_text
from petl.utils.text import plural

CHOICE_FILE = "choice.md"
BUDGET_KEYS = ("budget.params", "budget.train_seconds")
_SUFFIXES = {"k": 1e3, "m": 1e6, "g": 1e9}


@dataclass(frozen=True)
class Budget:
    """What the user can afford per task: trainable parameters and training seconds (``None``: no limit)."""

    params: float | None = None
    train_seconds: float | None = None

    @classmethod
    def parse(cls, own: dict[str, str]) -> Budget:
        """``budget.params=300k`` / ``1.5M`` / ``2e6`` and ``budget.train_seconds=600`` (no suffix) from the CLI.

        Raises:
            ValueError: a value that is not a positive number, naming it.

        """
        values = {}
        for key in BUDGET_KEYS:
            if key not in own:
                continue
            text = own[key].strip()
            # Seconds take no suffix: budget.train_seconds=10m read as 10 million seconds, not 10 minutes.
            scale = _SUFFIXES.get(text[-1:].lower(), 1.0) if key == "budget.params" else 1.0
            try:
                value = float(text[:-1] if scale != 1.0 else text) * scale
            except ValueError:
                value = math.nan
            if not value > 0 or math.isinf(value):
                what = "parameters may end in k, M or G" if key == "budget.params" else "seconds: 600 for 10 minutes"
                raise ValueError(f"{key}={own[key]}: expected a positive number ({what})")
            values[key.split(".", 1)[1]] = value
        return cls(**values)

    def describe(self) -> str:
        """The budget in words."""
        parts = []
        if self.params is not None:
            parts.append(f"at most {_params(self.params)} trainable parameters")
        if self.train_seconds is not None:
            parts.append(f"at most {self.train_seconds:g} s of training per run")
        return " and ".join(parts) or "no budget given (budget.params=, budget.train_seconds=)"

    def over(self, row: ExperimentRow) -> str | None:
        """Why ``row`` is over the budget, or ``None``."""
        if self.params is not None and row.trainable > self.params:
            return f"{_params(row.trainable)} parameters"
        seconds = train_seconds(row)
        if self.train_seconds is not None and math.isnan(seconds):
            # Records that predate train_seconds: not known to fit (overrun counts it furthest over, too).
            return "no training time recorded"
        if self.train_seconds is not None and seconds > self.train_seconds:
            return f"{seconds:.0f} s of training"
        return None

    def overrun(self, row: ExperimentRow) -> float:
        """How many times its budget ``row`` needs on the measure it is furthest over (parameters, seconds, or both).

        The row closest to the budget is the one a raise of it fits first: on a budget of seconds the quickest,
        not the one with the fewest parameters.  A row of no recorded time is furthest on a budget of seconds.
        """
        ratios = [row.trainable / self.params] if self.params is not None else []
        if self.train_seconds is not None:
            seconds = train_seconds(row)
            ratios.append(math.inf if math.isnan(seconds) else seconds / self.train_seconds)
        return max(ratios, default=0.0)


def _params(count: float) -> str:
    """A parameter count in words: ``1.23 M``, ``10.0 k``, or under a thousand the count itself (``10``)."""
    if count >= 1e5:
        return f"{count / 1e6:.2f} M"
    return f"{count / 1e3:.1f} k" if count >= 1e3 else f"{count:g}"


def train_seconds(row: ExperimentRow) -> float:
    """The row's final runs' mean training time (seconds, as recorded)."""
    seconds = [float(r.result.train_seconds) for r in row.counted_runs if r.result.train_seconds is not None]
    return sum(seconds) / len(seconds) if seconds else math.nan


def _seconds(row: ExperimentRow) -> str:
    """``12 s of training per run``, or that its records hold no training time."""
    seconds = train_seconds(row)
    return "no training time recorded" if math.isnan(seconds) else f"{seconds:.0f} s of training per run"


def chosen_run(row: ExperimentRow) -> Path:
    """The folder of the row's run to use: its lowest seed's whose training learned (picked without looking at test
    numbers: the verdict reads training figures only, :mod:`petl.train.learning`), else its lowest seed's.

    Of the runs its figures read (:attr:`~petl.bench.board.ExperimentRow.counted_runs`): a run of a seed outside the
    suite (an earlier ``seeds=``'s, in the same folder) is in none of the numbers the answer gives.
    """
    runs = row.counted_runs or row.runs
    learned = [r for r in runs if not r.not_learned]
    return min(learned or runs, key=lambda r: r.seed).path.parent


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The answer: the best row within the budget, the runner-up, the row to use and the paragraph saying so.

    Keyword-only: three fields are rows, which a positional call could swap without an error.
    """

    best: ExperimentRow | None
    runner_up: ExperimentRow | None
    taken: ExperimentRow | None
    """The row to use: the best, or the runner-up where the rank test cannot tell the two apart and it is smaller."""
    run_dir: Path | None
    paragraph: str


def choose(board: Leaderboard, budget: Budget, data: dict[str, Any] | None = None) -> Choice:
    """The best complete row within ``budget`` on the board's (one) task, and the paragraph naming it."""
    task = board.counted_tasks[0]  # the suite's: not a run of another task in the folder, in no mean
    complete = [r for r in board.rows if board.complete(r) and task in r.scores]
    within = [r for r in complete if budget.over(r) is None]
    # Equal accuracy: the row that trains fewer parameters first.  Equal as the rank test ties them (score_key): two
    # rows that got the same test images right, summed in another order, differ in the last bit of their means.
    within.sort(key=lambda r: (-score_key(r.scores[task].mean), r.trainable))
    over = [f"{r.experiment} ({budget.over(r)})" for r in complete if budget.over(r) is not None]
    where = f" on {data['task']} {data['root']} (fingerprint {data['fingerprint'][:12]})" if data else f" on {task}"
    head = f"**Which method for this data**{where}, {budget.describe()}: "
    left_out = _left_out(board, complete)
    if not within:
        why = "no row is complete yet" if not complete else "every complete row is over it: " + ", ".join(over)
        if complete:  # what to do: the runs stay, so a larger budget answers at once
            closest = min(complete, key=budget.overrun)
            why += (
                f"; the closest is {closest.experiment} ({_params(closest.trainable)} parameters, "
                f"{_seconds(closest)}): the same command with a budget it fits "
                "answers without training again"
            )
        return Choice(
            best=None, runner_up=None, taken=None, run_dir=None, paragraph=f"{head}nothing to choose, {why}{left_out}."
        )
    best = within[0]
    runner = within[1] if len(within) > 1 else None
    take = best  # the row whose run the commands use
    b = best.scores[task]
    text = head + (
        f"**{best.experiment}** reaches {b.mean:.2f} % test top-1 (mean of {plural(len(b.seeds), 'seed')}"
        f"{_std(b.std)}) with {_params(best.trainable)} trainable parameters and {_seconds(best)}"
    )
    if runner is not None:
        r = runner.scores[task]
        text += (
            f"; the runner-up, **{runner.experiment}**, reaches {r.mean:.2f} %{_std(r.std)} with "
            f"{_params(runner.trainable)} parameters, {b.mean - r.mean:.2f} points apart: "
        )
        verdict, take = _verdict(rank_test(board, within), best, runner, task)
        text += verdict
    else:
        text += "; no other row fits the budget"
    if over:
        text += f". Over the budget: {', '.join(over)}"
    text += left_out
    run = chosen_run(take)
    stuck = next((r.not_learned for r in take.runs if r.path.parent == run and r.not_learned), None)
    # Quoted for the shell: the commands are there to be copied, and a run folder under a path with a space
    # ("my runs/") or a quote would otherwise split into several arguments.
    quoted = shlex.quote(str(run))
    uses = [f"`petl-predict {quoted} IMAGES`"]
    if exportable(run):
        uses.append(f"`petl-export {quoted} out=exported` (a plain timm model)")
    # petl-serve serves tasks over one shared frozen backbone: it refuses a run that trains that backbone (full
    # fine-tuning, Partial-k) or that it cannot route (prompts under a pooling it cannot mask), so the answer offers
    # it only a run it takes, and otherwise gives its refusal, which is the reason whatever it is.
    refused = serve_refusal(run, take.experiment)
    if refused is None:
        uses.append(f"`petl-serve {quoted}` (an HTTP endpoint)")
    # Named, not "it": after a verdict naming two rows, "it" could mean either.
    text += f". Use {take.experiment}: {', '.join(uses[:-1])}{', or ' if len(uses) > 1 else ''}{uses[-1]}."
    if stuck:  # every seed of the row did not learn: the run named is one of them, and the user must know
        text += f" No seed of {take.experiment} learned; this run did not ({stuck})."
    if refused is not None:
        text += f" Not with petl-serve, which serves tasks over one shared frozen backbone and refuses it: {refused}."
    return Choice(best=best, runner_up=runner, taken=take, run_dir=run, paragraph=text)


def _left_out(board: Leaderboard, complete: list[ExperimentRow]) -> str:
    """``. Not weighed (...): a (2 of 3 seeds), b (no finished run)`` for what the answer could not compare."""
    planned = board.plan.experiments if board.plan is not None else ()
    found = {row.experiment: row for row in board.rows}
    missing = []
    for row in board.rows:
        if row not in complete:
            seeds = {seed for score in row.scores.values() for seed in score.seeds}
            wanted = f" of {len(board.plan.seeds)}" if board.plan is not None else ""
            missing.append(f"{row.experiment} ({len(seeds)}{wanted} seed(s) finished)")
    missing += [f"{name} (no finished run)" for name in planned if name not in found]
    if not missing:
        return ""
    return (
        f". Not weighed, since a run failed or has not finished (its error.log says which): {', '.join(missing)}; "
        "run the same command again to finish them"
    )


def _verdict(found: Ranking | str, best: ExperimentRow, runner: ExperimentRow, task: str) -> tuple[str, ExperimentRow]:
    """Whether the rank test tells the best row (by mean on ``task``) from the runner-up, which way, p and blocks;
    and the row to use: the smaller of the two where they cannot be told apart, else the best.
    """
    if not isinstance(found, Ranking):
        return f"no test tells them apart or not ({found})", best
    a, b = best.experiment, runner.experiment
    blocks = f"each of the {plural(len(found.blocks), found.block)} a block" + (
        " (one task)" if found.block == "seed" else ""
    )
    k = plural(len(found.methods), "row")
    if found.differ(a, b):
        friedman = (
            ""
            if math.isnan(found.p_value)
            else f" after Friedman's test over the {k} ({said_p(found.p_value, found.alpha)})"
        )
        p = found.p_values[a][b]
        below = "" if p == 0 else f" < {found.alpha:g}"  # "p < 1e-300" says so already ("p < 1e-300 < 0.05")
        test = f"{found.pair_test}{friedman}, {blocks}: {said_p(p, found.alpha)}{below}"
        first, second = (a, b) if found.mean_rank[a] <= found.mean_rank[b] else (b, a)
        said = (
            f"**{first}** ranks above **{second}** on this data (mean rank {found.mean_rank[first]:.2f} against "
            f"{found.mean_rank[second]:.2f}; {test})"
        )
        if first == a:
            return said, best
        # The best row is the best mean, the test compares ranks: a seed far out can leave the runner-up ranking
        # better in most blocks, and "they differ" beside the best row's name would read as its win.
        mean = (
            "the higher mean"
            if score_key(best.scores[task].mean) > score_key(runner.scores[task].mean)
            else "the same mean, fewer parameters"
        )
        disagree = f", though {a} has {mean}: the best by mean and the best by rank disagree, so neither wins plainly"
        return said + disagree, best
    if not found.omnibus_rejects:
        test = f"Friedman's test over the {k} within the budget, {blocks}, does not reject that they rank alike: "
        test += "every block ties them" if math.isnan(found.p_value) else said_p(found.p_value, found.alpha)
    else:
        after = " after Friedman's" if len(found.methods) >= 3 else ""
        test = f"{found.pair_test}{after}, {blocks}: {said_p(found.p_values[a][b], found.alpha)}"
    few = found.too_few_blocks()
    if few:
        # Not told apart, and no outcome over so few blocks could have been: say so, or it reads as a finding.
        test += f"; over {plural(len(found.blocks), found.block)} no outcome could tell them apart: {few}"
    # Equal within the test's reach: the smaller costs less to store and serve, so its run is the one to use.
    smaller = min((best, runner), key=lambda row: row.trainable)
    verdict = f"**{a}** and **{b}** cannot be told apart on this data ({test}); {smaller.experiment} is the smaller"
    return verdict, smaller


def _std(std: float) -> str:
    return "" if math.isnan(std) else f", std {std:.2f}"


def exportable(run_dir: Path) -> bool:
    """Whether ``petl-export`` can write the run as a plain timm model (its method folds into the backbone)."""
    import petl

    try:
        petl.unload(petl.load_run(run_dir).model)
    except ValueError:
        return False
    return True


def serve_refusal(run_dir: Path, task: str = "run") -> str | None:
    """Why ``petl-serve`` refuses the run, as ``petl.MultiTask`` says it (naming it ``task``), or ``None`` where it
    takes it: a method that trains the frozen backbone shared among tasks (full fine-tuning, Partial-k), or prompts
    under a pooling a mixed batch cannot mask.

    A run that cannot be loaded at all is no business of this check: ``petl-predict`` says why.
    """
    from petl.deploy.multitask import MultiTask, TaskRefused

    try:
        MultiTask.from_runs({task: run_dir})
    except TaskRefused as refused:
        if refused.mismatch:
            return None  # a run that fails load_run's checks is refused by petl-predict too, which says why
        return str(refused).splitlines()[0].rstrip(".")
    except ValueError:
        return None
    return None


def cost_lines(estimate: dict[str, Any] | None, measured_seconds: float | None) -> list[str]:
    """The cost said before the run against the time the run took.

    And the runs the sweep trained, where the estimate counted others: ``require_learning`` trains the finals of a
    point set aside again at the next point.
    """
    if estimate is None:
        return ["**Cost**: no estimate recorded (the runs were trained before `petl-bench` estimated them)."]
    said = f"**Cost**: estimated {duration(estimate['seconds'])} for {plural(estimate['runs'], 'run')} before training "
    said += f"({estimate['measured_at']}, {estimate['device']})"
    if measured_seconds is None:
        return [said + "; the real time is recorded once the sweep that estimated it ends."]
    ratio = measured_seconds / estimate["seconds"] if estimate["seconds"] > 0 else math.nan
    took = f"took {duration(measured_seconds)} ({ratio:.2f}x the estimate)"
    trained = estimate.get("measured_runs")  # absent from the records of before it was kept
    if trained is None or trained == estimate["runs"]:
        return [said + f"; they {took}."]
    # Under require_learning the finals of a point set aside are trained again at the next: more runs than counted.
    return [said + f"; the sweep trained {plural(trained, 'run')}, not {estimate['runs']}, and {took}."]


def write_choice(
    output_dir: Path,
    choice: Choice,
    estimate: dict[str, Any] | None,
    measured: float | None,
    figures: Sequence[str] = ("pareto.png",),
) -> Path:
    """``choice.md``: the paragraph and the cost, beside the leaderboard and the ``figures`` its report drew."""
    path = Path(output_dir) / CHOICE_FILE
    lines = ["# Which method for this data", "", choice.paragraph, "", *cost_lines(estimate, measured), ""]
    also = ", ".join(f"`{name}`" for name in (".csv", ".html", *figures))
    lines += [
        f"The leaderboard: `leaderboard.md` (also {also}) in this folder; its section *Which differences are real* "
        "gives the rank test in full.",
        "",
    ]
    write_text(path, "\n".join(lines))  # whole or not at all, as every file petl writes
    return path
