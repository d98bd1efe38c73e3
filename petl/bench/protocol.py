"""Model selection on val, then the reported runs: the protocol of a suite that declares ``search:``.

Per task and experiment (a *cell*):

1. **Search.**  One trial per point of the grid (the suite's space, less what the experiment pins, plus
   the experiment's own ``search:``), each trained on ``train800`` with one seed (``search_seed``) and
   scored on ``val200`` only: trials run with ``train.eval_test=false``, so no test image is ever read
   before the choice.  Trials live in ``<task>/<experiment>/search/<point>/``.
2. **Choice.**  The trial with the highest val top-1 after its last epoch (PETL_Vision's default,
   ``final_acc_hp: True``: OSU-MLB/PETL_Vision@245d262 experiment/run.py:L118-120 and
   experiment/config/default_vtab_processed.yml:L61).  Ties go to the first point in grid order (keys
   in the order declared, values in the order listed): 200 val images give accuracies in steps of 0.5
   points, so ties happen, and a fixed rule keeps the choice reproducible.
3. **Final runs.**  The chosen point trains on ``final_split`` (``train800val200``: all 1,000 images, no
   val) once per suite seed into ``<task>/<experiment>/seed<k>/``; the test split is evaluated once,
   after the last epoch.  Each final ``result.json`` gets ``result["selection"]``: the space, every
   trial's overrides and val accuracy, and ``chosen``.

An experiment with ``calibrate_once`` (NOAH's subnet search) calibrates in its first trial only: the other
trials and the finals reuse that choice (:mod:`petl.bench.calibration`), so the finals retrain what was chosen
on train800, as NOAH's scripts do.

A suite with ``require_learning`` also passes over grid points at which training did not learn
(:mod:`petl.train.learning`: final train loss at chance, not below its first epoch's, or not finite, or the last
epoch's train top-1 not above chance), judged on training figures only: a trial that did not learn ranks after
every trial that did; and a point whose final runs include one that did not learn is *unstable* for the cell: those
finals move, whole and kept, to
``<task>/<experiment>/unstable/<point>/seed<k>/`` (reports do not read them) and the best remaining point's
finals train in their place, in the same invocation (a final still training in another sweep is judged when it
has finished, by the invocation that finds it).  A point is set aside only while another point whose trial
learned remains, so a method that learns at no point keeps its finals (the report marks them).  Where this
changes the choice, the selection record says so under ``learning``.

Everything is resumable the way a plain sweep is: finished trials and finals are skipped, a cell whose
search is incomplete (a trial failed, or another sweep still holds one) waits for the next invocation.
Trials keep ``result.json``, ``metrics.jsonl`` and ``config.yaml`` but not their weights: the final run
retrains the chosen point, and a full fine-tuning trial's weights on ViT-B would be 340 MB each.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from petl.bench.suite import FINAL_SPLIT, Experiment, Suite, format_value, override
from petl.bench.sweep import PlannedRun, SweepSummary, reused_from, run_dir_for, run_sweep, task_folder
from petl.data.registry import TRAIN, VAL
from petl.store.files import RESULT_FILE, WEIGHTS_FILE
from petl.store.result import ResultError, RunResult, read_result, write_result
from petl.train.learning import run_not_learned

SEARCH_DIR = "search"
UNSTABLE_DIR = "unstable"  # finals set aside by require_learning, one folder per point
SEARCH_SPLIT = TRAIN  # the only split with a val split (val200) to select on
METRIC = "val_top1"
RULE = "highest val top-1 after the last epoch; ties: first point in grid order"
LEARNING_RULE = (
    "require_learning: points whose trial did not learn rank last; a point whose finals did not learn is set "
    "aside (unstable/) while another point whose trial learned remains"
)

# Options the protocol sets itself; a command-line override of one would silently undo the protocol.
_PROTOCOL_KEYS = ("data.split", "train.eval_test")


def grid(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every point of a grid, keys in declared order, the last key varying fastest; ``[{}]`` for no space."""
    keys = list(space)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(space[k] for k in keys))]


def point_name(point: dict[str, Any]) -> str:
    """A trial's folder name: ``train.lr=0.001,train.weight_decay=0.0001`` with unsafe characters replaced."""
    text = ",".join(f"{k}={format_value(v)}" for k, v in point.items()) or "defaults"
    return re.sub(r"[^A-Za-z0-9._=,+-]+", "_", text)


def point_overrides(point: dict[str, Any]) -> list[str]:
    """A grid point as Hydra overrides."""
    return [override(k, v) for k, v in point.items()]


@dataclass(frozen=True)
class Trial:
    """One point of a cell's search and the run that scores it."""

    point: dict[str, Any]
    run: PlannedRun


@dataclass
class Cell:
    """One experiment on one task under a searching suite: its trials, and how to plan its finals."""

    task: str
    experiment: Experiment
    space: dict[str, list[Any]]
    trials: list[Trial]
    base: tuple[str, ...]
    extra: tuple[str, ...]
    final_split: str
    seeds: list[int]
    output_dir: Path
    search_seed: int
    calibrated_by: Path | None = None  # calibrate_once: the run whose choice the cell's other runs reuse
    require_learning: bool = False

    @property
    def label(self) -> str:
        """Short name for progress lines."""
        return f"{self.task} {self.experiment.name}"

    @property
    def folder(self) -> Path:
        """``<output_dir>/<task folder>/<experiment>``: the cell's trials, finals and set-aside finals."""
        return self.output_dir / task_folder(self.task) / self.experiment.name

    def unstable_points(self) -> set[str]:
        """Folder names of the points whose finals ``require_learning`` set aside (``unstable/<point>/``)."""
        root = self.folder / UNSTABLE_DIR
        return {p.name for p in root.iterdir() if p.is_dir()} if root.is_dir() else set()

    def selection(self) -> dict[str, Any] | None:
        """The search record with the chosen point, or ``None`` while a trial has no result yet."""
        scored, learned = [], []
        for trial in self.trials:
            if not trial.run.is_done():  # not trained yet, or damaged (the next sweep trains it again)
                return None
            result = read_result(trial.run.run_dir / RESULT_FILE)
            if result is None:
                return None
            scored.append(
                {
                    "overrides": trial.point,
                    METRIC: getattr(result, METRIC),
                    "best_val_top1": result.best_val_top1,
                    "output_dir": trial.run.run_dir.relative_to(self.output_dir).as_posix(),
                    # Only where it happened, so the records of searches without a divergence stay as they were.
                    **({"diverged": True} if result.diverged else {}),
                }
            )
            learned.append(run_not_learned(trial.run.run_dir, result) is None)

        def score(entry: dict[str, Any]) -> float:
            return -1.0 if entry[METRIC] is None else entry[METRIC]

        # max() keeps the first of equal keys: ties go to the earlier grid point.  A trial without a val
        # score (one that diverged, see sweep.run_sweep) ranks last.
        best = max(scored, key=score) if scored else None
        record = {
            "space": self.space,
            "split": SEARCH_SPLIT,
            "scored_on": VAL,
            "seed": self.search_seed,
            "metric": METRIC,
            "rule": RULE,
            "trials": scored,
            "chosen": best["overrides"] if best else {},
        }
        if self.require_learning and best is not None:
            unstable = self.unstable_points()
            usable = [t for t, ok in zip(scored, learned, strict=True) if ok and _name(t) not in unstable]
            choice = max(usable, key=score) if usable else best
            if choice is not best:
                # Only where the rule changed the choice, so the records of other cells stay as they were.
                record["chosen"] = choice["overrides"]
                record["learning"] = {
                    "rule": LEARNING_RULE,
                    "best_val": best["overrides"],
                    "not_learned": [_name(t) for t, ok in zip(scored, learned, strict=True) if not ok],
                    "unstable": sorted(unstable),
                }
        return record

    def _trials_learned(self) -> dict[str, bool]:
        # Point folder name -> whether its trial finished and learned.
        verdicts = {}
        for trial in self.trials:
            result = _read(trial.run.run_dir)
            learned = result is not None and run_not_learned(trial.run.run_dir, result) is None
            verdicts[point_name(trial.point)] = learned
        return verdicts

    def set_aside_unstable(self) -> list[str]:
        """Under ``require_learning``, move the finished finals of points at which training did not learn.

        A final's point is the one its config trained.  Its finals move to ``unstable/<point>/seed<k>/`` when
        that point's trial or one of its finals did not learn (or the point was set aside before), and only
        while another point whose trial learned remains.  Nothing is deleted; a folder already at the target
        is left where it is.

        Returns:
            One line per run moved, or that could not be.

        """
        if not self.require_learning:
            return []
        trials = self._trials_learned()
        unstable = self.unstable_points()
        by_point: dict[str, list[Path]] = {}
        stuck: set[str] = set()
        for seed in self.seeds:
            run_dir = run_dir_for(self.output_dir, self.task, self.experiment.name, seed)
            result = _read(run_dir)
            if result is None:
                continue  # not finished (or another sweep is training it): the next invocation looks again
            name = point_name({k: _config_value(result.config or {}, k) for k in self.space})
            by_point.setdefault(name, []).append(run_dir)
            if run_not_learned(run_dir, result):
                stuck.add(name)
        lines = []
        for name, run_dirs in by_point.items():
            if not (name in stuck or not trials.get(name, True) or name in unstable):
                continue
            if not any(ok and other != name and other not in unstable for other, ok in trials.items()):
                continue  # no point left that learned: the finals stay, and the report marks them
            for run_dir in run_dirs:
                target = self.folder / UNSTABLE_DIR / name / run_dir.name
                if target.exists():
                    lines.append(f"{self.label}: {run_dir} trained unstable point {name}, but {target} exists")
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.rename(run_dir, target)  # atomic: a sweep beside this one sees the run here or there
                except OSError as error:
                    lines.append(f"{self.label}: could not set aside {run_dir}: {error}")
                    continue
                lines.append(f"{self.label}: {name} did not learn; {run_dir.name} set aside in {target.parent}")
        return lines

    def finals(self, chosen: dict[str, Any]) -> list[PlannedRun]:
        """The reported runs of the chosen point: one per seed, on the final split."""
        runs = []
        for seed in self.seeds:
            run_dir = run_dir_for(self.output_dir, self.task, self.experiment.name, seed)
            overrides = (
                *self.base,
                *point_overrides(chosen),
                f"data.split={self.final_split}",
                f"seed={seed}",
                *self.extra,  # the user's, after the protocol's own (plan_cells refused any clash)
                f"output_dir={format_value(str(run_dir))}",
            )
            source = reused_from(self.calibrated_by, run_dir)
            runs.append(PlannedRun(self.task, self.experiment.name, seed, run_dir, overrides, calibrated_by=source))
        return runs


def plan_cells(
    suite: Suite,
    experiments: Sequence[Experiment],
    tasks: Sequence[str],
    seeds: Sequence[int],
    output_dir: Path,
    extra_overrides: Sequence[str] = (),
) -> list[Cell]:
    """The cells of a searching suite, each with its planned trials.

    Args:
        suite: a suite with a ``search`` space.
        experiments: the experiments to run.
        tasks: petl dataset names.
        seeds: the final runs' seeds.
        output_dir: the results root.
        extra_overrides: the user's command-line overrides (applied after the suite's and experiment's).

    Raises:
        ValueError: a command-line override of a searched key or of a key the protocol sets.

    """
    extra_keys = {o.partition("=")[0].lstrip("+~") for o in extra_overrides}
    cells = []
    for task in tasks:
        for exp in experiments:
            space = suite.space_for(exp, task)
            clash = sorted(extra_keys & (set(space) | set(_PROTOCOL_KEYS)))
            if clash:
                raise ValueError(
                    f"{', '.join(clash)}: set per run by suite {suite.name}'s selection protocol "
                    f"(searched: {', '.join(space) or 'nothing'}); edit the suite or experiment file instead"
                )
            base = (*suite.overrides(), *exp.overrides(), *suite.task_overrides(exp.name, task), f"data={task}")
            names = [point_name(p) for p in grid(space)]
            if len(set(names)) < len(names):
                # Folder names replace unsafe characters: two points must not share one trial folder.
                raise ValueError(f"{exp.name}: search points {names} share a folder name; use distinct values")
            # A cell whose experiment pins every searched key has nothing to select: it goes straight to its
            # finals, or, under `pinned_trial`, first trains its one point (grid({}) == [{}], folder "defaults")
            # for the val curve.
            points = grid(space) if space or suite.pinned_trial else []
            trial_dirs = [output_dir / task_folder(task) / exp.name / SEARCH_DIR / point_name(p) for p in points]
            # calibrate_once: the first trial calibrates (without trials, the first seed's final); the task's
            # other runs reuse its choice.
            calibrating = None
            if exp.calibrate_once:
                calibrating = trial_dirs[0] if trial_dirs else run_dir_for(output_dir, task, exp.name, seeds[0])
            trials = []
            for point, run_dir in zip(points, trial_dirs, strict=True):
                overrides = (
                    *base,
                    *point_overrides(point),
                    f"data.split={SEARCH_SPLIT}",
                    f"seed={suite.search_seed}",
                    "train.eval_test=false",
                    *extra_overrides,
                    f"output_dir={format_value(str(run_dir))}",
                )
                label = f"{task} {exp.name} search {point_name(point)}"
                source = reused_from(calibrating, run_dir)
                run = PlannedRun(task, exp.name, suite.search_seed, run_dir, overrides, label, True, source)
                trials.append(Trial(point, run))
            cells.append(
                Cell(
                    task,
                    exp,
                    space,
                    trials,
                    base,
                    tuple(extra_overrides),
                    suite.final_split or FINAL_SPLIT,
                    list(seeds),
                    output_dir,
                    suite.search_seed,
                    calibrating,
                    suite.require_learning,
                )
            )
    return cells


def _name(entry: dict[str, Any]) -> str:
    return point_name(entry["overrides"])


def _read(run_dir: Path) -> RunResult | None:
    # A finished run's record; None while it has none, or a damaged one (the sweep trains that again).
    try:
        return read_result(run_dir / RESULT_FILE) if (run_dir / RESULT_FILE).is_file() else None
    except (ResultError, KeyError, TypeError, RecursionError):
        return None


def _config_value(config: dict[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def stamp_selection(run: PlannedRun, selection: dict[str, Any]) -> str | None:
    """Record the search in a finished final run's ``result.json`` (again after an interrupted stamp).

    Returns:
        ``None``, or why the run cannot carry this selection: it trained another point (the search space or
        the trials changed after it finished), which a finished run's folder is never silently relabelled for.

    """
    path = run.run_dir / RESULT_FILE
    if (damage := run.damage()) is not None:
        return f"{run.label}: {damage}; the next invocation trains it again"
    result = read_result(path)
    if result is None or result.selection == selection:
        return None
    trained = {key: _config_value(result.config or {}, key) for key in selection["chosen"]}
    if trained != selection["chosen"]:
        return (
            f"{run.label}: trained {trained} but the search now chooses {selection['chosen']}; "
            f"delete {run.run_dir} to train the new choice"
        )
    result.selection = selection
    write_result(path, result)
    return None


def run_protocol(cells: Sequence[Cell], progress: bool = True, **sweep_fns: Any) -> SweepSummary:
    """Run every cell's search, then the final runs of every cell whose search is complete.

    Trials of all cells come first (one sweep), then the finals (a second sweep), so an interrupted
    session leaves whole searches behind it rather than half a cell; run the same command again to go on.

    Args:
        cells: from :func:`plan_cells`.
        progress: show the sweeps' progress bars.
        **sweep_fns: ``train_fn`` / ``compose_fn`` for :func:`petl.bench.sweep.run_sweep` (tests pass fakes).

    Returns:
        Both sweeps' summary; cells whose search is incomplete are listed in ``waiting``.

    """
    trials = [t.run for cell in cells for t in cell.trials]
    summary = run_sweep(trials, progress=progress, **sweep_fns) if trials else SweepSummary()
    stale = set(summary.stale)
    ready = []
    for cell in cells:
        for trial in cell.trials:
            # The final run retrains the chosen point: a trial's weights are never used again.
            if trial.run.is_done():
                (trial.run.run_dir / WEIGHTS_FILE).unlink(missing_ok=True)
        if any(t.run.label in stale for t in cell.trials):
            summary.waiting.append(f"{cell.label}: a trial holds another config's result, final runs wait")
            continue
        summary.set_aside += cell.set_aside_unstable()
        ready.append(cell)
    # Under require_learning a final that did not learn sets its point aside, and the next point's finals train
    # in this invocation, not the next one: a sweep that goes on to other methods leaves no cell resting on a run
    # at chance.  Each round sets one more point aside, so the rounds end.
    while ready:
        finals, chosen, picked = [], [], []
        for cell in ready:
            selection = cell.selection()
            if selection is None:
                summary.waiting.append(f"{cell.label}: search incomplete, final runs wait for the next invocation")
                continue
            runs = cell.finals(selection["chosen"])
            finals += runs
            chosen += [(run, selection) for run in runs]
            picked.append((cell, selection["chosen"]))
        summary.merge(run_sweep(finals, progress=progress, **sweep_fns))
        for run, selection in chosen:
            if run.is_done() and (problem := stamp_selection(run, selection)):
                summary.failed.append(problem)
        ready = []
        for cell, point in picked:
            moved = cell.set_aside_unstable()
            summary.set_aside += moved
            if moved and (selection := cell.selection()) is not None and selection["chosen"] != point:
                ready.append(cell)
    return summary
