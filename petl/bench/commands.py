"""The ``petl-bench`` commands (run, report, compare, list, commands, speed, params): see :mod:`petl.cli.bench`.

Each takes the command's words (``key=value``) and returns an exit status; errors are raised, and the shell words
them in one line.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from petl.bench import notes, protocol, report
from petl.bench import suite as suites
from petl.bench.args import (
    CONFIGS_KEYS,
    as_bool,
    check_run_keys,
    configs_folder,
    flags_as_keys,
    folders,
    parse_args,
    split_list,
)
from petl.bench.own_run import OWN_DATA_KEYS, run_on_own_data
from petl.bench.report import write_report
from petl.bench.sweep import PlannedRun, SweepSummary, check_configs, check_results_folder, plan, run_sweep
from petl.store.files import CONFIG_FILE, RESULT_FILE
from petl.store.result import ResultError
from petl.utils.errors import USAGE_ERROR
from petl.utils.progress import petl_log_lines
from petl.utils.random import MAX_SEED
from petl.utils.text import plural

PROG = "petl-bench"


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


SWEEP_KEYS = {
    "suite",
    "methods",
    "tasks",
    "seeds",
    "output_dir",
    "report",
    "dry_run",
    "progress",
} | CONFIGS_KEYS


def cmd_run(args: Sequence[str]) -> int:
    """Run a suite (restricted by methods/tasks/seeds), skipping finished runs, then build the report."""
    own, overrides = parse_args(flags_as_keys(args), SWEEP_KEYS | OWN_DATA_KEYS)
    check_run_keys(overrides, SWEEP_KEYS | OWN_DATA_KEYS)
    yes = as_bool("yes", own.get("yes", "false"))
    if "suite" not in own:
        # A bare `petl-bench` ran suite=mini, every method on every mini task and seed, where a newcomer asked what
        # the command does; the help's grammar has suite= as no optional key.
        raise SystemExit(
            "petl-bench: no suite= given: name one (petl-bench list shows each with its experiments, tasks and seeds; "
            "suite=choose data=folder data.root=PATH compares methods on your images; petl-bench --help)"
        )
    _check_own_data_keys(own)
    configs = configs_folder(own)
    suite = suites.load_suite(own["suite"], configs)
    names, tasks, seeds = _restriction(own, suite)
    experiments = _experiments(names, configs, own, suite)
    if "data" in own:  # your own images as the task (petl.bench.own_run): cost first, then the answer
        return run_on_own_data(suite, experiments, seeds, own, overrides, yes, _finish)
    output_dir = Path(own.get("output_dir", f"runs/bench/{suite.name}"))
    check_results_folder(output_dir)
    check_configs(suite, configs, experiments, tasks, overrides)
    if suite.search:
        return run_selection(suite, experiments, tasks, seeds, output_dir, overrides, own)
    runs = plan(experiments, tasks, seeds, output_dir, suite.overrides(), overrides, suite)
    done = sum(r.is_done() for r in runs)
    print(
        f"petl-bench: suite {suite.name}: {plural(len(experiments), 'experiment')} x "
        f"{plural(len(tasks), 'task')} x {plural(len(seeds), 'seed')} = {len(runs)} runs "
        f"into {output_dir} ({done} already done)"
    )
    if as_bool("dry_run", own.get("dry_run", "false")):
        for run in runs:
            print(_dry_run_line(run))
        return 0
    with petl_log_lines():  # each run's epoch lines and "resuming ... from epoch K/N", as petl-run logs them
        summary = run_sweep(runs, progress=as_bool("progress", own.get("progress", "true")))
    return _finish(summary, output_dir, own, any(r.is_done() for r in runs), suite)


def _check_own_data_keys(own: dict[str, str]) -> None:
    """Refuse a budget or ``--yes`` without ``data=``: only a run on your own images reads them (:mod:`own_run`).

    A suite's sweep answered no question within budget.params= and asked nothing --yes would answer.

    Raises:
        SystemExit: naming the key (one line, exit 2).

    """
    if "data" in own:
        return
    given = [key for key in sorted(OWN_DATA_KEYS - {"data"}) if key in own]
    given = [key for key in given if key != "yes" or as_bool("yes", own["yes"])]  # yes=false is its default
    if given:
        key = given[0]
        shown = "--yes" if key == "yes" else f"{key}={own[key]}"
        raise SystemExit(
            f"petl-bench: {shown} acts on a run on your own images only (suite=choose data=folder data.root=PATH), "
            f"and no data= is given: add data=, or drop {'--yes' if key == 'yes' else f'{key}='}"
        )


def _restriction(own: dict[str, str], suite: suites.Suite) -> tuple[list[str], list[str], list[int]]:
    """The experiments, tasks and seeds of ``methods=`` / ``tasks=`` / ``seeds=``, else the suite's.

    Raises:
        SystemExit: one that lists nothing (a sweep of no run is a slip), a seed that is not a whole number from 0
            on, or a name (a seed) listed twice.

    """
    listed = {}
    for key, default in (("methods", suite.experiments), ("tasks", suite.tasks), ("seeds", suite.seeds)):
        listed[key] = split_list(own[key]) if key in own else default
        if not listed[key]:
            raise SystemExit(f"petl-bench: {key}= lists nothing: name at least one, or leave it out to run the suite's")
    try:
        seeds = [int(s) for s in listed["seeds"]]
    except ValueError:
        seeds = [-1]
    if min(seeds) < 0 or max(seeds) > MAX_SEED:
        # petl-run's seed is 0 to MAX_SEED: another would fail each of its runs in its error.log, one by one.
        raise SystemExit(
            f"petl-bench: seeds={own['seeds']}: expected whole numbers from 0 to {MAX_SEED}, e.g. seeds=0,1"
        )
    for key, values in (("methods", listed["methods"]), ("tasks", listed["tasks"]), ("seeds", seeds)):
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:
            # The same run planned twice (seeds=0,00 too): one folder, trained once and counted twice, and
            # `commands` would print two jobs into one folder.
            raise SystemExit(f"petl-bench: {key}={own[key]}: {', '.join(twice)} listed more than once: list each once")
    return listed["methods"], listed["tasks"], seeds


def _experiments(names: list[str], configs: Path, own: dict[str, str], suite: suites.Suite) -> list[suites.Experiment]:
    """The experiments ``names``; one unknown is named with where it was listed (the suite file, or ``methods=``).

    Raises:
        ValueError: an unknown experiment, named with its suite file or ``methods=``, or a malformed experiment file.

    """
    where = "methods=" if "methods" in own else f"{configs / 'suites' / suite.name}.yaml: experiments"
    experiments = []
    for name in names:
        try:
            experiments.append(suites.load_experiment(name, configs))
        except ValueError as error:
            if not str(error).startswith("unknown experiment"):
                raise  # a malformed experiment file, which the message names
            raise ValueError(f"{where}: {error}") from None
    return experiments


def _dry_run_line(run: PlannedRun) -> str:
    """``done`` / ``todo``, the run and its overrides (with the calibration it reuses, once that run has one)."""
    try:
        overrides = run.full_overrides()
    except (ValueError, ResultError) as error:
        overrides, note = None, f"  (cannot reuse the calibration: {error})"
    else:
        note = f"  (+ the calibration of {run.calibrated_by}, not run yet)" if overrides is None else ""
    state = "done  " if run.is_done() else "todo  "
    # A finished run, or an interrupted one (its config.yaml, no result.json), is checked as the sweep checks it;
    # one whose config.yaml is damaged the sweep trains again (PlannedRun.damage): a todo.
    interrupted = (run.run_dir / CONFIG_FILE).is_file() and not (run.run_dir / RESULT_FILE).exists()
    checked = run.is_done() or interrupted and run.damage() is None
    if checked and overrides is not None and (stale := _holds_another_config(overrides)) is not None:
        # The sweep would fail this run, not skip or resume it (an edited suite, another suite's run in this folder).
        state, note = "stale ", f"  ({stale})"
    return state + run.label + "  " + " ".join(overrides or run.overrides) + note


def _holds_another_config(overrides: list[str]) -> str | None:
    """Why a finished run's folder holds another config than ``overrides`` (the sweep's check), else ``None``."""
    from petl.train.config import default_config
    from petl.train.output_dir import check_finished

    try:
        check_finished(default_config(overrides))
    except ValueError as error:
        return str(error)
    return None


def _finish(summary: SweepSummary, output_dir: Path, own: dict[str, str], any_done: bool, suite: suites.Suite) -> int:
    print(f"petl-bench: {summary.line()}")
    for line in summary.held_elsewhere:
        print(f"  held by another sweep: {line}")
    for line in summary.failed:
        print(f"  failed: {line}")
    for line in summary.diverged:
        print(f"  diverged (scored last in its search): {line}")
    for line in summary.set_aside:
        print(f"  set aside: {line}")
    for line in summary.waiting:
        print(f"  waiting: {line}")
    if summary.stale:
        # Runs of another config stand in this suite's folders: a leaderboard would show them as this suite's.
        print(
            f"petl-bench: leaderboard not written: {len(summary.stale)} run folder(s) hold another config (above)",
            file=sys.stderr,
        )
    elif as_bool("report", own.get("report", "true")) and any_done:
        # The whole suite's plan, even when methods=/tasks=/seeds= ran part of it: the rest shows as not run yet.
        plan = report.Plan(suite.name, tuple(suite.experiments), tuple(suite.tasks), tuple(suite.seeds))
        write_report(output_dir, configs_dir=configs_folder(own), plan=plan)
        print(
            f"petl-bench: leaderboard written to {output_dir}/leaderboard.{{md,csv,html}}, "
            + ", ".join(report.figures_drawn(output_dir))
        )
    if (idle := summary.idle_line()) is not None:
        print(f"petl-bench: {idle}")
    return 1 if summary.failed else 0


def run_selection(
    suite: suites.Suite,
    experiments: list[suites.Experiment],
    tasks: list[str],
    seeds: list[int],
    output_dir: Path,
    overrides: list[str],
    own: dict[str, str],
) -> int:
    """Run a searching suite: selection on val, then the final runs (see :mod:`petl.bench.protocol`)."""
    cells = protocol.plan_cells(suite, experiments, tasks, seeds, output_dir, overrides)
    trials = [t.run for cell in cells for t in cell.trials]
    print(
        f"petl-bench: suite {suite.name}: {plural(len(experiments), 'experiment')} x "
        f"{plural(len(tasks), 'task')}: {len(trials)} "
        f"selection trials on {protocol.SEARCH_SPLIT} (seed {suite.search_seed}, scored on val200), then "
        f"{len(seeds)} final runs per cell on {suite.final_split} into {output_dir} "
        f"({sum(r.is_done() for r in trials)} trials already done)"
    )
    if as_bool("dry_run", own.get("dry_run", "false")):
        for cell in cells:
            for trial in cell.trials:
                print(_dry_run_line(trial.run))
            selection = cell.selection()
            if selection is None:
                print(f"later {cell.label}: {len(seeds)} final runs once its search is complete")
                continue
            for run in cell.finals(selection["chosen"]):
                print(_dry_run_line(run))
        return 0
    with petl_log_lines():
        summary = protocol.run_protocol(cells, progress=as_bool("progress", own.get("progress", "true")))
    finals_done = any(any(c.folder.glob("seed*/result.json")) for c in cells)
    return _finish(summary, output_dir, own, finals_done, suite)


def cmd_commands(args: Sequence[str]) -> int:
    """Print one ``petl-run --multirun`` command per experiment that writes the suite's results layout.

    Extra arguments (``hydra/launcher=submitit_slurm``, ``hydra.launcher.partition=gpu``, ``train.*``...)
    are appended to every command, so a cluster launcher spreads the runs and ``petl-bench report``
    reads the same folders afterwards.  Nothing is run.
    """
    own, overrides = parse_args(args, SWEEP_KEYS - {"report", "dry_run", "progress"})
    check_run_keys(overrides, SWEEP_KEYS - {"report", "dry_run", "progress"})
    if "suite" not in own:
        # As a bare `petl-bench` is refused: printing suite=mini's lines unasked would start its 567 runs once pasted.
        raise SystemExit(
            "petl-bench commands: no suite= given: name one (petl-bench list shows each with its experiments, tasks "
            "and seeds; petl-bench --help)"
        )
    configs = configs_folder(own)
    suite = suites.load_suite(own["suite"], configs)
    if suite.per_task:
        raise SystemExit(f"petl-bench commands: suite {suite.name} sets options per task; one multirun line cannot")
    if suite.search:
        # One multirun line per experiment cannot pick a configuration on val before the final runs.
        raise SystemExit(
            f"petl-bench commands: suite {suite.name} selects on val before its final runs, which petl-run "
            "--multirun cannot express; start `petl-bench suite=...` on each node (per-run locks share the work)"
        )
    names, tasks, seed_numbers = _restriction(own, suite)
    seeds = [str(s) for s in seed_numbers]
    output_dir = own.get("output_dir", f"runs/bench/{suite.name}")
    experiments = _experiments(names, configs, own, suite)
    # A launcher's keys (hydra/launcher=...) and sweeps (train.lr=a,b) are petl-run --multirun's, not one config's.
    single = [o for o in overrides if not o.lstrip("+~").startswith("hydra") and "," not in o.partition("=")[2]]
    check_configs(suite, configs, experiments, tasks, single)
    once = [e.name for e in experiments if e.calibrate_once]
    if once and len(seeds) > 1:
        # Each multirun job would calibrate on its own; petl-bench reuses the first seed's calibration.
        raise SystemExit(
            f"petl-bench commands: {', '.join(once)} calibrate once per task and reuse it for every seed, which "
            f"--multirun cannot express; run them with `petl-bench suite={suite.name} methods=...`, or give one seed"
        )
    for experiment in experiments:
        name = experiment.name
        # Hydra resolves ${data.name} and ${seed} per job; petl.slug is sweep.task_folder's rule (mini/digits ->
        # mini-digits), giving each job the folder petl-bench would use.
        parts = [
            "petl-run",
            "--multirun",
            *suite.overrides(),
            *experiment.overrides(),
            *suite.experiment_overrides(name),
            f"data={','.join(tasks)}",
            *([f"data.split={suite.final_split}"] if suite.final_split else []),
            f"seed={','.join(seeds)}",
            *overrides,
            f"output_dir={output_dir}/${{petl.slug:${{data.name}}}}/{name}/seed${{seed}}",
        ]
        print(" ".join(shlex.quote(p) for p in parts))
    return 0


def cmd_report(args: Sequence[str]) -> int:
    """Build the leaderboard of a results folder."""
    positional = folders(args, "report")
    own, rest = parse_args([a for a in args if "=" in a], {"out", "configs_dir", "suite"})
    if len(positional) != 1 or rest:
        given = repr(" ".join(args)) if args else "nothing"
        raise SystemExit(
            f"petl-bench report: expected RESULTS_DIR [out=DIR] [configs_dir=DIR] [suite=NAME], got {given}"
        )
    if own.get("out") == "":
        # Path("") is the current folder: the report would go there while the line below named "/leaderboard.md".
        raise ValueError("out= names no folder: give out=DIR, or leave out= out to write into RESULTS_DIR")
    out = own.get("out", positional[0])
    # A configs_dir= that is no configs folder is refused (as `list` does), not read as "no experiment files".
    configs = configs_folder(own) if "configs_dir" in own else None
    # suite=NAME: the suite the runs came from, so that the report marks what it has not run yet.
    plan = report.plan_of(own["suite"], configs) if "suite" in own else None
    board = write_report(positional[0], own.get("out"), configs, plan)
    print(
        f"petl-bench: {plural(len(board.rows), 'experiment')} x {plural(len(board.tasks), 'task')} -> "
        f"{out}/leaderboard.{{md,csv,html}}" + "".join(f", {out}/{name}" for name in report.figures_drawn(out))
    )
    # Names as they are on the console: their Markdown escapes (\*) are for the pages.
    if plan is not None:
        print(f"petl-bench: {report.progress(board, name=str)}")
    if board.published_names and notes.benchmark_tasks(board):
        print(f"petl-bench: {notes.ranking_line(board, name=str)}")
    return 0


def cmd_compare(args: Sequence[str]) -> int:
    """Compare the orderings of two results folders' leaderboards (see :mod:`petl.bench.compare`).

    ``out=FILE`` that exists is refused unless ``overwrite=true``: the page never replaces a file silently (a
    folder's own ``leaderboard.md``, say); one inside a run folder is refused even then (a run's files are
    replaced by a run only), as is a folder.
    """
    from petl.bench import compare
    from petl.store.files import write_text
    from petl.utils.paths import cannot_write_in

    positional = folders(args, "compare")
    own, rest = parse_args([a for a in args if "=" in a], {"suites", "out", "overwrite", "configs_dir"})
    if len(positional) != 2 or rest:
        raise SystemExit(
            "petl-bench compare: expected RESULTS_A RESULTS_B [suites=NAME_A,NAME_B] [out=FILE [overwrite=true]] "
            f"[configs_dir=DIR], got {repr(' '.join(args)) if args else 'nothing'}"
        )
    names = split_list(own["suites"]) if "suites" in own else [None, None]
    if len(names) != 2:
        raise SystemExit(
            f"petl-bench compare: suites={own['suites']}: name two suites, one per results folder, as suites=A,B"
        )
    overwrite = as_bool("overwrite", own.get("overwrite", "false"))
    if "overwrite" in own and "out" not in own:
        raise SystemExit("petl-bench compare: overwrite= acts on out=FILE; give out= too, or leave overwrite= out")
    if own.get("out") == "":
        raise ValueError("out= names no file: give out=FILE.md, or leave out= out to print the page")
    if "out" in own:
        report.check_not_in_run(Path(own["out"]), "out")
        if Path(own["out"]).is_dir():
            raise ValueError(f"out={own['out']} is a folder: name a new .md file")
        if Path(own["out"]).exists() and not overwrite:
            raise ValueError(f"{own['out']} exists; choose another out=, or pass overwrite=true to replace it")
        unwritable = cannot_write_in(Path(own["out"]).parent, "choose another out=")
        if unwritable:
            raise ValueError(f"out={own['out']}: {unwritable}")
    compare.check_same_data(*positional)
    configs = configs_folder(own) if "configs_dir" in own else None
    boards = tuple(
        report.build_board(folder, configs, report.plan_of(name, configs) if name else None)
        for folder, name in zip(positional, names, strict=True)
    )
    page = compare.markdown(compare.compare(*boards))
    if "out" in own:
        write_text(Path(own["out"]), page)
        print(f"petl-bench: {own['out']}")
    else:
        print(page, end="")
    return 0


def suite_backbone(suite: suites.Suite) -> tuple[str, int | str]:
    """The timm backbone a suite trains and its input resolution (:func:`petl.bench.board.suite_size`)."""
    from petl.backbones.models import DEFAULT_MODEL
    from petl.bench.board import suite_size

    model = suite.groups.get("model", {})
    size = suite_size(model)
    return model.get("name", DEFAULT_MODEL), "its default" if size is None else size


def cmd_list(args: Sequence[str]) -> int:
    """Print the suites and experiments found; with ``suite=NAME``, that suite's experiments, one a line, in its order.

    The one-a-line form is for scripts (``benchmarks/mini_sweep.sh`` takes its methods from it) and reads no
    experiment file, so it needs no torch.
    """
    own, rest = parse_args(args, CONFIGS_KEYS | {"suite"})
    if rest:  # `suit=mini` listed everything, as if no suite were named
        raise SystemExit(f"petl-bench list: unknown argument(s) {rest}; known: configs_dir, suite")
    configs = configs_folder(own)
    if "suite" in own:
        print("\n".join(suites.load_suite(own["suite"], configs).experiments))
        return 0
    broken = 0
    # One malformed file is named (on stderr) and the rest are still listed; the status then says so.
    for name in suites.list_suites(configs):
        try:
            s = suites.load_suite(name, configs)
        except ValueError as error:
            broken += 1
            _error(str(error))
            continue
        backbone, size = suite_backbone(s)
        print(
            f"suite {name}: {plural(len(s.experiments), 'experiment')}, {plural(len(s.tasks), 'task')}, "
            f"seeds {s.seeds}, backbone {backbone} at {size} px"
        )
    for name in suites.list_experiments(configs):
        try:
            e = suites.load_experiment(name, configs)
        except ValueError as error:
            broken += 1
            _error(str(error))
            continue
        print(f"experiment {name}: {' '.join(e.overrides())}")
    return USAGE_ERROR if broken else 0


def cmd_params(args: Sequence[str]) -> int:
    """Compare each experiment's parameter count with its published row (see :mod:`petl.bench.params`)."""
    from petl.bench.params import main as params_main

    return params_main(args)


def cmd_speed(args: Sequence[str]) -> int:
    """Time the methods (see :mod:`petl.bench.speed`, imported on use: no other command builds models)."""
    from petl.bench.speed import main as speed_main

    return speed_main(args)
