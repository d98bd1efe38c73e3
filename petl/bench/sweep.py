"""Run a suite's experiments × tasks × seeds in-process through ``petl.run.train``.

Each run owns ``<output_dir>/<task folder>/<experiment>/seed<k>/`` (:func:`task_folder`).  A run whose
``result.json`` exists is done and skipped, so an interrupted sweep resumes by running the same command again.
A run being trained holds a lock file in its folder, so a second sweep on the same folder (another terminal,
another node on a shared filesystem) trains something else instead of writing into the same files.
This is bookkeeping, not a scheduler: spreading runs over GPUs or SLURM is Hydra's launchers' job
(see benchmarks/README.md).
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from petl.bench.calibration import calibration_overrides
from petl.bench.suite import Experiment, Suite, format_value, override
from petl.store.files import CHECKPOINT_FILE, CONFIG_FILE, RESULT_FILE, DamagedFileError, read_config, write_text
from petl.store.lock import LOCK_FILE as LOCK_FILE  # the lock is petl-run's too: one home, re-exported here
from petl.store.lock import acquire_lock, release_lock
from petl.store.result import ResultError, RunResult, read_result, write_result
from petl.utils.errors import ConfigError, UsageError, exit_status
from petl.utils.paths import cannot_write_in
from petl.utils.progress import progress_bar
from petl.utils.text import first_line

ERROR_FILE = "error.log"
# The layer of a run config's overrides that the user typed (_layers), named so in a refusal.
COMMAND_LINE = "the command line"

TrainFn = Callable[[Any], dict]
ComposeFn = Callable[[list[str]], Any]
CheckFn = Callable[[Any], None]

# The run this process is training (run_sweep sets it around its train_fn; Ctrl-C leaves it set): petl-bench's
# Ctrl-C line says from it whether that run kept an epoch to resume (interrupted_line).
_training: PlannedRun | None = None


@dataclass(frozen=True)
class PlannedRun:
    """One training run of a sweep: where it writes and the overrides that define it."""

    task: str
    experiment: str
    seed: int
    run_dir: Path
    overrides: tuple[str, ...]
    name: str = ""
    score_divergence: bool = False
    calibrated_by: Path | None = None  # the run whose calibrate hook chose this run's options (calibrate_once)

    @property
    def label(self) -> str:
        """Short name for progress lines (``name`` if given, e.g. a selection trial's)."""
        return self.name or f"{self.task} {self.experiment} seed{self.seed}"

    def is_done(self) -> bool:
        """Whether the run has already written its result (a readable one: a damaged file is trained again)."""
        return (self.run_dir / RESULT_FILE).is_file() and self.damage() is None

    def full_overrides(self) -> list[str] | None:
        """``overrides`` with the options ``calibrated_by``'s run chose; ``None`` while that run has no result.

        Raises:
            ValueError: that run's result records no options to reuse.

        """
        if self.calibrated_by is None:
            return list(self.overrides)
        chosen = calibration_overrides(self.calibrated_by)
        if chosen is None:
            return None
        # Before output_dir, which stays last so no override can send two runs into one folder.
        return [*self.overrides[:-1], *chosen, self.overrides[-1]]

    def damage(self) -> str | None:
        """Why this run's ``result.json`` cannot be read (cut short, hand-edited) or is another task's or seed's, or,
        for a run interrupted (no ``result.json``), its ``config.yaml`` is damaged; else ``None``.
        """
        path = self.run_dir / RESULT_FILE
        try:
            result = read_result(path)
        except (ResultError, KeyError, TypeError, RecursionError) as error:
            return str(error) if isinstance(error, ResultError) else f"{path}: {error!r}"
        if result is None and (self.run_dir / CONFIG_FILE).exists():
            # Nothing tells which config its checkpoint had, so it cannot be checked against the plan or resumed:
            # trained anew as a damaged result.json is (resume=false sets the folder aside, nothing deleted).
            try:
                read_config(self.run_dir)
            except DamagedFileError as error:
                return str(error)
        if result is not None and result.dataset != self.task:
            # Copied or moved from another task's folder: the reports would not count it here (collect.folder_problem).
            return f"{path}: a run of {result.dataset}, not of {self.task} whose folder it is in"
        if result is not None and result.seed != self.seed:
            # Copied from another seed's folder, or edited: the reports would not count it here either.
            return f"{path}: a run of seed {result.seed}, not of seed {self.seed} whose folder it is in"
        return None


def reused_from(calibrating: Path | None, run_dir: Path) -> Path | None:
    """The ``calibrated_by`` of the run in ``run_dir``: the calibrating run's folder, unless it is that run."""
    return calibrating if calibrating != run_dir else None


def check_results_folder(folder: Path) -> None:
    """Refuse a results folder no run can be written into, before a sweep plans or trains anything.

    A file in the way, a read-only or full file system, a name longer than the file system takes: each would
    otherwise stop the sweep at its first run's lock with a bare ``OSError`` (exit 1).  This is the check petl-run
    makes of its ``output_dir`` (:func:`petl.utils.paths.cannot_write_in`), said the same way (exit 2).  A small
    file is written and removed, and the folders made for it are removed again, so a dry run is left without a trace.

    Raises:
        UsageError: one line naming ``folder`` and why.

    """
    unwritable = cannot_write_in(folder, "choose another output_dir", fill=True)
    if unwritable is not None:
        raise UsageError(f"output_dir {unwritable}")


def task_folder(task: str) -> str:
    """The folder of a task's runs in a results folder: its registry name with ``/`` as ``-`` (``mini-digits``).

    One level per task, so ``ls runs/`` lists a suite's tasks and ``runs/<task>/<experiment>/`` sits directly
    under it; the family prefix keeps ``vtab/...``, ``fgvc/...`` and ``mini/...`` names apart; and it is the
    folder name petl-run's default ``output_dir`` gives a task (its ``petl.slug`` resolver), so a run reads the
    same wherever it was started.
    """
    return task.replace("/", "-")


def run_dir_for(output_dir: Path, task: str, experiment: str, seed: int) -> Path:
    """The folder one run owns: ``<output_dir>/<task folder>/<experiment>/seed<k>``."""
    return output_dir / task_folder(task) / experiment / f"seed{seed}"


def plan(
    experiments: Sequence[Experiment],
    tasks: Sequence[str],
    seeds: Sequence[int],
    output_dir: Path,
    base_overrides: Sequence[str] = (),
    extra_overrides: Sequence[str] = (),
    suite: Suite | None = None,
) -> list[PlannedRun]:
    """Every run of a sweep, seed by seed, so a partial sweep already covers all cells once.

    Args:
        experiments: the experiments to run.
        tasks: petl dataset names.
        seeds: random seeds.
        output_dir: the results root.
        base_overrides: the suite's overrides (applied first).
        extra_overrides: the user's command-line overrides (applied last, so they win).
        suite: its per-task settings follow the experiment's overrides, and its ``final_split`` (when set)
            is every run's ``data.split``.

    Returns:
        The planned runs, in execution order.

    """
    runs = []
    for seed in seeds:
        for task in tasks:
            for exp in experiments:
                run_dir = run_dir_for(output_dir, task, exp.name, seed)
                # calibrate_once: the first seed's run calibrates, the task's other runs reuse its choice.
                calibrating = run_dir_for(output_dir, task, exp.name, seeds[0]) if exp.calibrate_once else None
                overrides = (
                    *base_overrides,
                    *exp.overrides(),
                    *(suite.task_overrides(exp.name, task) if suite else ()),
                    f"data={task}",
                    *([f"data.split={suite.final_split}"] if suite and suite.final_split else []),
                    f"seed={seed}",
                    *extra_overrides,
                    # Last, so no override can send two runs into one folder.
                    f"output_dir={format_value(str(run_dir))}",
                )
                source = reused_from(calibrating, run_dir)
                runs.append(PlannedRun(task, exp.name, seed, run_dir, overrides, calibrated_by=source))
    return runs


def check_configs(
    suite: Suite,
    configs: Path,
    experiments: Sequence[Experiment],
    tasks: Sequence[str],
    extra_overrides: Sequence[str] = (),
) -> None:
    """Compose each experiment's run config before anything trains, naming the file that holds a bad key or value.

    A typo in an experiment's method option, a search over a key the run config (or the experiment's method)
    lacks, an unknown task: each would otherwise fail every run of the sweep, one by one, in its ``error.log``.
    Each experiment composes on the first task once per position in its search lists (every searched value is
    composed, not every grid point); the task names are checked as choices.  ``train.cache_features=false`` is
    checked on every task too (a task's training images may be augmented, fgvc/*'s are by default), and every
    experiment and task where it cannot act is named in the one line (:func:`_check_cache_option`).

    Raises:
        ConfigError: one line naming the suite or experiment file (or the command line) and the config's error.

    """
    from petl.train.cache import CacheOptionError
    from petl.train.config import check_group_choice

    suite_file = configs / "suites" / f"{suite.name}.yaml"
    for task in tasks:
        try:
            check_group_choice("data", task)
        except ConfigError as error:
            where = f"{suite_file}: tasks" if task in suite.tasks else "the command line's tasks="
            raise ConfigError(f"{where}: {error}") from None
    refused: list[tuple[str, str, str]] = []  # (experiment, task, why) where train.cache_features=false cannot act
    setting = ""  # where train.cache_features=false is set
    for exp in experiments:
        space = suite.space_for(exp, tasks[0])
        why = first = None
        for i in range(max((len(values) for values in space.values()), default=1)):
            try:
                composed = _compose_layers(_layers(suite, configs, exp, tasks[0], i, extra_overrides))
            except CacheOptionError as error:
                why = error.reason  # the other tasks are checked below, the other searched values once it is dropped
                break
            if i == 0:
                first = composed
        if why is None and first.train.cache_features:
            continue
        setting = setting or _setter(_layers(suite, configs, exp, tasks[0], 0, extra_overrides), "train.cache_features")
        refused += [
            (exp.name, task, reason)
            for task, reason in _check_cache_option(suite, configs, exp, tasks, why, extra_overrides)
        ]
    if refused:
        raise ConfigError(_cache_refusal(setting, refused, experiments, tasks))


def _layers(
    suite: Suite, configs: Path, exp: Experiment, task: str, position: int, extra_overrides: Sequence[str]
) -> list[tuple[str, list[str]]]:
    """One run config's overrides as (where they are written, overrides) layers, in the order they apply.

    ``position`` picks each searched key's value (the last one past the end of a shorter list).
    """
    suite_file = configs / "suites" / f"{suite.name}.yaml"
    exp_file = configs / "experiments" / f"{exp.name}.yaml"
    exp_source = str(exp_file) if exp_file.is_file() else f"experiment {exp.name} (method {exp.method['name']})"
    layers = [
        (str(suite_file), [*suite.overrides(), f"data={task}"]),
        (exp_source, exp.overrides()),
        (f"{suite_file}: per_experiment/per_task {exp.name}", suite.task_overrides(exp.name, task)),
    ]
    for key, values in suite.space_for(exp, task).items():  # each searched key as a layer of its own, named by its file
        source = exp_source if key in exp.search else f"{suite_file}: search (experiment {exp.name})"
        layers.append((source, [override(key, values[min(position, len(values) - 1)])]))
    layers.append((COMMAND_LINE, list(extra_overrides)))
    return layers


def layer_sources(layers: list[tuple[str, list[str]]]) -> dict[str, str]:
    """The keys a file among ``layers`` sets, each with that file's name (the last layer's that sets it).

    :func:`petl.train.config.default_config` names such a value so in a refusal (``train.epochs=20 is set by
    .../suites/mini_selection.yaml``), where it would ask the user to drop a value they never typed.  A key the command
    line sets is the user's own, and is left out.
    """
    sources: dict[str, str] = {}
    for source, part in layers:
        for key in (o.lstrip("+~").partition("=")[0] for o in part):
            if source == COMMAND_LINE:
                sources.pop(key, None)
            else:
                sources[key] = source
    return sources


def _compose_layers(layers: list[tuple[str, list[str]]]) -> Any:
    """The run config of ``layers``; a :class:`ConfigError` names the first layer whose addition fails.

    A :class:`~petl.train.cache.CacheOptionError` is raised as it is, for :func:`check_configs` to gather.
    """
    from petl.train.cache import CacheOptionError
    from petl.train.config import default_config

    try:
        return default_config([o for _, part in layers for o in part])
    except CacheOptionError:
        raise
    except ConfigError:
        # The first layer whose addition fails is the one to fix.
        for n in range(1, len(layers) + 1):
            # The failing layer is named first: its own keys need no "set by".
            sources = {k: v for k, v in layer_sources(layers[:n]).items() if v != layers[n - 1][0]}
            try:
                default_config([o for _, part in layers[:n] for o in part], sources)
            except ConfigError as error:
                raise ConfigError(f"{layers[n - 1][0]}: {error}") from None
        raise


def _setter(layers: list[tuple[str, list[str]]], key: str) -> str:
    """Where ``key`` is set last among ``layers`` (its value is that layer's): the layer's name."""
    for source, part in reversed(layers):
        if any(o.lstrip("+~").partition("=")[0] == key for o in part):
            return source
    return COMMAND_LINE


def _check_cache_option(
    suite: Suite,
    configs: Path,
    exp: Experiment,
    tasks: Sequence[str],
    why: str | None,
    extra_overrides: Sequence[str],
) -> list[tuple[str, str]]:
    """The tasks on which ``exp``'s ``train.cache_features=false`` cannot act, each with why.

    ``why``: the refusal on the first task, or ``None`` where it was composed there.  Nothing frozen in front of what
    the method trains, or a backbone in train mode, holds on every task; whether the training images are augmented
    only the task tells (:meth:`petl.data.DatasetInfo.crops`), and it is checked on each without composing its whole
    config again (half a second a config: a suite has hundreds).  A task with settings of its own (``per_task``) is
    composed whole.
    """
    from petl.train import cache
    from petl.train.config import check_cache_option_acts, compose_config

    first = _layers(suite, configs, exp, tasks[0], 0, extra_overrides)
    base = compose_config([o for _, part in first for o in part])
    found = []
    for task in tasks:
        if suite.task_overrides(exp.name, task) != suite.task_overrides(exp.name, tasks[0]):
            try:
                _compose_layers(_layers(suite, configs, exp, task, 0, extra_overrides))
            except cache.CacheOptionError as error:
                found.append((task, error.reason))
            continue
        if why is not None and why != cache.AUGMENTED:  # the method's, or the backbone mode's: the same on any task
            found.append((task, why))
            continue
        on_task = copy.deepcopy(base)
        on_task.data.name = task
        try:
            check_cache_option_acts(on_task, None)
        except cache.CacheOptionError as error:
            found.append((task, error.reason))
    return found


def _cache_refusal(
    setting: str, refused: list[tuple[str, str, str]], experiments: Sequence[Experiment], tasks: Sequence[str]
) -> str:
    """The one line naming every experiment and task where ``train.cache_features=false`` cannot act, and why."""
    by_experiment: dict[tuple[str, str], list[str]] = {}  # (why, experiment) -> its tasks
    for experiment, task, why in refused:
        by_experiment.setdefault((why, experiment), []).append(task)
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}  # (why, tasks) -> the experiments
    for (why, experiment), its_tasks in by_experiment.items():
        groups.setdefault((why, tuple(its_tasks)), []).append(experiment)
    parts = [
        f"{', '.join(names)} on {'every task' if len(on) == len(tasks) > 1 else ', '.join(on)}: {why}"
        for (why, on), names in groups.items()
    ]
    pairs = len(experiments) * len(tasks)
    # tasks= only where there are tasks to pick: a choose on your data (data=) has one, and refuses tasks=.
    keys = "methods=, tasks=" if len(tasks) > 1 else "methods="
    todo = (
        "drop it"
        if len(refused) == pairs
        else f"drop it, or leave those out ({keys}) and run them in a sweep of their own without it"
    )
    return (
        f"{setting}: train.cache_features=false cannot act in {len(refused)} of {pairs} experiment x task pairs, "
        f"where no features are cached either way: {'; '.join(parts)}; {todo}"
    )


@dataclass
class SweepSummary:
    """What a sweep did: counts by outcome, and the failed runs with their error logs."""

    total: int = 0
    already_done: int = 0
    trained: int = 0
    held_elsewhere: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    diverged: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)  # finals moved to unstable/ (protocol.require_learning)
    # A failed run's label -> the exit status petl-run would have ended it with (bad input 2, else 1).
    failed_status: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        """One-line summary for the console."""
        waiting = f", {len(self.waiting)} waiting for a search or a calibration" if self.waiting else ""
        diverged = f", {len(self.diverged)} trials diverged (scored last)" if self.diverged else ""
        aside = f", {len(self.set_aside)} finals set aside (did not learn)" if self.set_aside else ""
        return (
            f"{self.total} runs: {self.already_done} already done, {self.trained} trained, "
            f"{len(self.held_elsewhere)} held by another sweep, {len(self.failed)} failed{diverged}{aside}{waiting}"
        )

    def idle_line(self) -> str | None:
        """The closing line of a sweep that trained nothing because other sweeps hold its runs, else ``None``.

        Sweeps side by side on one folder share its runs (the per-run locks), so this is no failure (exit 0),
        but a sweep that only found runs held by others says so last, not in the middle of its summary.
        """
        if self.trained or not self.held_elsewhere:
            return None
        return (
            f"trained nothing: {len(self.held_elsewhere)} run(s) are being trained by another sweep (above) and the "
            "rest were done or failed; run the same command again once it has ended to see them all"
        )

    def merge(self, other: SweepSummary) -> None:
        """Add another sweep's counts and lists to this one."""
        self.total += other.total
        self.already_done += other.already_done
        self.trained += other.trained
        self.held_elsewhere += other.held_elsewhere
        self.failed += other.failed
        self.waiting += other.waiting
        self.diverged += other.diverged
        self.stale += other.stale
        self.set_aside += other.set_aside


def _diverged_result(run: PlannedRun, error: Exception, cfg: Any) -> RunResult:
    """The result.json of a selection trial that diverged: no scores, why, and the config it was trained with."""
    config = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else None
    # The method its config trained (records from before this named the experiment: the reader lets them be).
    method = cfg.method.name if isinstance(cfg, DictConfig) else run.experiment
    return RunResult(method=method, dataset=run.task, seed=run.seed, diverged=str(error), config=config)


def _default_fns() -> tuple[TrainFn, ComposeFn, CheckFn]:
    # Imported late: the sweep is testable with fakes, and `petl-bench report` never needs the engine.
    from petl.train.config import default_config
    from petl.train.output_dir import check_finished
    from petl.train.runner import train

    return train, default_config, check_finished


def run_sweep(
    runs: Sequence[PlannedRun],
    train_fn: TrainFn | None = None,
    compose_fn: ComposeFn | None = None,
    progress: bool = True,
    check_fn: CheckFn | None = None,
    users_runs: bool = True,
) -> SweepSummary:
    """Train every planned run that has no result yet, one after another, in this process.

    A run that raises is logged to ``<run_dir>/error.log`` and the sweep goes on; the caller decides
    the exit status from :attr:`SweepSummary.failed`.  A finished run is checked against its planned
    config (``check_fn``); one trained with another config (an edited suite) is reported as failed and
    listed in ``stale``, never counted as this config's result.  A run with ``calibrated_by`` trains with
    the options that run's calibration chose, once it has finished (later in this sweep, or in the next one:
    until then the run is listed in ``waiting``).

    Args:
        runs: from :func:`plan`.
        train_fn: ``petl.run.train`` unless given (tests pass a fake).
        compose_fn: ``petl.run.default_config`` unless given.
        progress: show the sweep's progress bar (runs done / total, current run, ETA), where stderr is a terminal
            (:mod:`petl.utils.progress`); elsewhere a line per run as it starts (``sweep: run 3/40: LABEL``).
        check_fn: raises when a finished run's folder holds another config; with the engine's defaults
            ``petl.train.output_dir.check_finished``, else none unless given.
        users_runs: the runs are the user's, so Ctrl-C's line names the one it stopped (:func:`interrupted_line`);
            ``False`` for the estimate's tiny runs in a temporary folder, which the same command never resumes.

    Returns:
        The sweep's summary.

    """
    if train_fn is None or compose_fn is None:
        default_train, default_compose, default_check = _default_fns()
        check_fn = check_fn or (default_check if train_fn is None else None)
        train_fn = train_fn or default_train
        compose_fn = compose_fn or default_compose
    global _training
    _training = None  # one an earlier sweep of this process left at its Ctrl-C
    summary = SweepSummary(total=len(runs))
    pending = [r for r in runs if not r.is_done()]
    summary.already_done = len(runs) - len(pending)
    pending_ids = {id(r) for r in pending}
    for run in runs:
        if check_fn is not None and id(run) not in pending_ids:
            try:
                overrides = run.full_overrides()
                if overrides is not None:  # None: its calibrating run is gone, nothing to compare with
                    check_fn(compose_fn(overrides))
            except Exception as error:  # a ConfigError naming the difference
                summary.stale.append(run.label)
                summary.failed.append(f"{run.label}: {error}")
                summary.already_done -= 1  # failed, not this config's result: the counts add up to the total
    # Starting the bar at the runs already done keeps its ETA based on this session's pace only.
    bar = progress_bar(total=len(runs), initial=summary.already_done, desc="sweep", unit="run", show=progress)
    # Where no bar is drawn (stderr a file: a job scheduler's log), a line names each run as it starts and how far
    # the sweep is, which the bar would show; the run's own "training ..." line follows.
    say_runs = progress and bar.disable
    counted = summary.already_done  # runs taken care of, as the bar counts them

    def train(run: PlannedRun, overrides: list[str]) -> None:
        global _training
        bar.set_postfix_str(run.label)
        try:
            taken = acquire_lock(run.run_dir)
        except OSError as error:  # the disk filled up (or went read-only) during the sweep: this run cannot start
            why = f"cannot write to {run.run_dir} ({error.strerror or error})"
            summary.failed.append(f"{run.label}: {why}")
            bar.write(f"FAILED {run.label}: {why}")
            return
        if not taken:
            summary.held_elsewhere.append(run.label)
            if check_fn is not None:
                try:  # another sweep trains it: with this config, or it is not this suite's result
                    check_fn(compose_fn(overrides))
                except Exception as error:  # a ConfigError naming the difference
                    summary.stale.append(run.label)
                    summary.failed.append(f"{run.label}: {error}")
            return
        cfg = None
        try:
            # Another sweep may have finished it between our first look and the lock.
            if not run.is_done():
                (run.run_dir / ERROR_FILE).unlink(missing_ok=True)
                interrupted = (run.run_dir / CONFIG_FILE).is_file() and not (run.run_dir / RESULT_FILE).exists()
                damage = run.damage()
                if check_fn is not None and interrupted and damage is None:
                    try:  # an interrupted run: resuming it with another config (an edited suite) would be refused
                        check_fn(compose_fn(overrides))
                    except ConfigError as error:
                        summary.stale.append(run.label)
                        summary.failed.append(f"{run.label}: {error}")
                        bar.write(f"FAILED {run.label}: {error}")
                        return
                if damage is not None:
                    # resume=false moves the damaged run aside (petl.train.output_dir.set_aside) and trains it
                    # anew; the output_dir override stays last.
                    bar.write(f"petl-bench: warning: {damage}: training {run.label} again")
                    overrides.insert(len(overrides) - 1, "resume=false")
                cfg = compose_fn(overrides)
                if say_runs:
                    print(f"sweep: run {counted + 1}/{len(runs)}: {run.label}", flush=True)
                # Runs share this process; each resets its own peak memory (petl.train.runner._train_and_record).
                _training = run if users_runs else None
                train_fn(cfg)
                _training = None
                summary.trained += 1
            else:
                summary.already_done += 1  # by the sweep that held it: counted, so the summary adds up to the total
        except Exception as error:  # one bad run must not end a day-long sweep
            _training = None
            log_file = run.run_dir / ERROR_FILE
            try:
                write_text(log_file, traceback.format_exc())
                see = f"see {log_file}"
            except OSError as unwritten:
                # A full disk fails the run and then its log: the run's own line says what happened.
                see = f"{first_line(error, type(error).__name__)}; {log_file} not written ({unwritten.strerror})"
            if run.score_divergence and getattr(error, "diverged", False):
                # A selection trial whose loss went non-finite has its answer: this point diverges.  Its
                # result (no val score, so it ranks last) lets the cell's finals go ahead; without it the
                # cell would wait, resume, and diverge again on every invocation.
                write_result(run.run_dir / RESULT_FILE, _diverged_result(run, error, cfg))
                summary.diverged.append(f"{run.label}: {error}")
                bar.write(f"DIVERGED {run.label}: scored last ({see})")
            else:
                summary.failed.append(f"{run.label}: {see}")
                summary.failed_status[run.label] = exit_status(error)
                bar.write(f"FAILED {run.label} ({see})")
        finally:
            release_lock(run.run_dir)

    def try_run(run: PlannedRun) -> bool:
        """Train ``run`` unless it waits for its calibrating run; whether it was taken care of."""
        nonlocal counted
        try:
            overrides = run.full_overrides()
        except (ValueError, ResultError) as error:
            summary.failed.append(f"{run.label}: cannot reuse the calibration: {error}")
        else:
            if overrides is None:
                return False
            train(run, overrides)
        bar.update(1)
        counted += 1
        return True

    try:
        # A run whose calibrating run is not finished yet goes last: by then this sweep may have trained it.
        later = [run for run in pending if not try_run(run)]
        for run in later:
            if not try_run(run):
                summary.waiting.append(f"{run.label}: waits for the calibration in {run.calibrated_by}")
                bar.update(1)
                counted += 1
    finally:
        bar.close()
    return summary


def interrupted_line() -> str:
    """petl-bench's Ctrl-C line: what the run being trained kept, and what the same command does with it.

    A run keeps a checkpoint as each epoch ends, which the next sweep resumes.  Interrupted before its first, or
    while it trained anew a run whose damaged folder the next sweep would set aside again (:meth:`PlannedRun.damage`),
    it keeps no epoch: the same command trains it from the start.  Interrupted while no run trains (the sweep's
    checks, a report), there is no such run to speak of.
    """
    run = _training
    generic = "error: interrupted; run the same command again to go on (finished runs are kept"
    if run is None or (run.run_dir / RESULT_FILE).is_file() and run.damage() is None:
        return f"{generic})"
    if (run.run_dir / CHECKPOINT_FILE).is_file() and run.damage() is None:
        return f"{generic}, an interrupted run resumes from its last finished epoch)"
    return (
        f"error: interrupted before the first epoch of {run.label} finished, so no epoch of it is kept: run the same "
        "command again to go on (finished runs are kept, that run trains from the start)"
    )
