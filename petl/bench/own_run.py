"""``petl-bench suite=choose data=folder data.root=PATH``: a searching suite on your own data, cost first.

The steps, in order: read the data (every image decoded once: classes, split sizes, fingerprint,
:mod:`petl.bench.own_data`); plan the suite's cells on it (:mod:`petl.bench.protocol`, as for a registered
task); measure what the remaining runs will cost here (:mod:`petl.bench.estimate`) and ask before training
(``--yes`` answers for a script: without it, input that is not a terminal stops before the measuring with exit 2
and one line saying so); run the
protocol; write the leaderboard, then ``choice.md`` with the answer within ``budget.params=`` /
``budget.train_seconds=`` and the estimate against the real time (:mod:`petl.bench.choice`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from petl.bench import choice, own_data, protocol, report
from petl.bench import estimate as costs
from petl.bench.args import as_bool, configs_folder
from petl.bench.suite import Experiment, Suite
from petl.bench.sweep import COMMAND_LINE, check_configs, check_results_folder, layer_sources
from petl.cli.args import plain
from petl.data.images import decode_progress
from petl.store.lock import acquire_lock, describe_holder, release_lock
from petl.utils.errors import RUN_ERROR

YES_FLAG = "--yes"
# The run command's own keys for own data: the dataset, and the budget the answer keeps to.
OWN_DATA_KEYS = {"data", "yes", *choice.BUDGET_KEYS}

Finish = Callable[..., int]


def _note(line: str) -> None:
    """A progress line where no bar is drawn (stderr a file), on stderr as the command's other notes."""
    print(f"petl-bench: {line}", file=sys.stderr, flush=True)


def check_can_ask(yes: bool) -> None:
    """Refuse, before anything is measured, to wait for an answer no one can give.

    Raises:
        SystemExit: input that is not a terminal, without ``--yes`` (one line: what to pass; exit 2).

    """
    if not yes and not sys.stdin.isatty():
        raise SystemExit(f"petl-bench: not started: input is not a terminal; pass {YES_FLAG} to train without asking")


def confirm(yes: bool) -> bool:
    """Whether to train: ``--yes``, else the user's answer at a terminal (:func:`check_can_ask` first)."""
    check_can_ask(yes)
    return yes or input("train now? [y/N] ").strip().lower() in ("y", "yes")


def runs_to_train(cells: list[protocol.Cell]) -> bool:
    """Whether any selection trial or final run of ``cells`` is unfinished (what the estimate counts), unmeasured."""
    return any(sum(costs.unfinished(cell)) for cell in cells)


def run_on_own_data(
    suite: Suite,
    experiments: list[Experiment],
    seeds: list[int],
    own: dict[str, str],
    overrides: list[str],
    yes: bool,
    finish: Finish,
) -> int:
    """Run ``suite`` on the data ``data=`` names (its options among ``overrides``); the exit status."""
    from petl.train.cache import CacheOptionError
    from petl.train.config import compose_config, default_config

    if "tasks" in own:
        raise ValueError(f"tasks={own['tasks']} and data={own['data']}: give one (data= makes your data the task)")
    if not suite.search:
        raise ValueError(f"suite {suite.name} does not select on val; run your data with a searching suite (choose)")
    budget = choice.Budget.parse(own)
    on_data = [*suite.overrides(), f"data={own['data']}", *overrides]
    suite_file = str(configs_folder(own) / "suites" / f"{suite.name}.yaml")
    sources = layer_sources([(suite_file, suite.overrides()), (COMMAND_LINE, [f"data={own['data']}", *overrides])])
    try:
        cfg = default_config(on_data, sources)
    except CacheOptionError:
        # Refused for the run config's default method (LoRA), which need not be among the experiments: they are
        # checked next, and its config composed apart from that.
        cfg = compose_config(on_data)
    # Each experiment's config, as a sweep checks it (train.cache_features=false, which most methods cannot take, is
    # named for each of them at once), before the images are decoded and the estimate builds each model.
    check_configs(suite, configs_folder(own), experiments, [own["data"]], overrides)
    # Every image is decoded here first: a folder of a few thousand photos says how far it is (after 5 s).
    progress = as_bool("progress", own.get("progress", "true"))
    with decode_progress(_note if progress else None):
        data = own_data.read_own_data(cfg)
    print(f"petl-bench: {data.line()}")
    setup = own_data.run_setup(cfg, default_config([f"data={own['data']}", *data_options(overrides)]))
    output_dir = Path(own.get("output_dir") or data.default_output_dir(suite.name, setup))
    check_results_folder(output_dir)
    if not acquire_lock(output_dir):
        # Not bad input, and nothing here is broken: one line and the status of a run that could not complete.
        print(
            f"petl-bench: error: another choose is running on {output_dir} ({describe_holder(output_dir)}); "
            "run the same command again once it has ended (finished runs are kept)",
            file=sys.stderr,
        )
        return RUN_ERROR
    try:
        own_data.claim_output_dir(output_dir, data, setup)
        return _run_locked(suite, experiments, seeds, own, overrides, yes, finish, budget, data, output_dir)
    finally:
        release_lock(output_dir)


def _run_locked(
    suite: Suite,
    experiments: list[Experiment],
    seeds: list[int],
    own: dict[str, str],
    overrides: list[str],
    yes: bool,
    finish: Finish,
    budget: choice.Budget,
    data: own_data.OwnData,
    output_dir: Path,
) -> int:
    suite = dataclasses.replace(suite, experiments=[e.name for e in experiments], tasks=[data.task], seeds=seeds)
    cells = protocol.plan_cells(suite, experiments, [data.task], seeds, output_dir, overrides)
    trials = sum(len(c.trials) for c in cells)
    print(
        f"petl-bench: suite {suite.name} on your data: {len(experiments)} experiments: {trials} selection trials "
        f"(seed {suite.search_seed}) + {len(seeds)} final runs each (seeds {', '.join(map(str, seeds))}) into "
        f"{output_dir}"
    )
    stale = stale_runs(cells)
    if stale:
        # What the real run would do: fail each of them, after training the rest.  Said before, dry run or not.
        raise ValueError(
            f"{output_dir}: {len(stale)} finished run(s) hold another config ({stale[0]}); leave output_dir= out "
            "to give this setup a folder of its own, or choose another output_dir"
        )
    dry_run = as_bool("dry_run", own.get("dry_run", "false"))
    if not dry_run and runs_to_train(cells):
        # Before the measuring, which builds and steps every experiment (minutes on a real backbone): a script that
        # cannot answer learns what to pass without waiting for it.
        check_can_ask(yes)
    estimate = costs.estimate(cells, data, say=lambda line: print(f"petl-bench: {line}", flush=True))
    for line in estimate.lines():
        print(f"petl-bench: {line}")
    if dry_run:
        return 0
    if estimate.runs and not confirm(yes):
        print("petl-bench: not started")
        return 0
    if estimate.runs:
        estimate.write(output_dir)
    tick = time.perf_counter()
    summary = protocol.run_protocol(cells, progress=as_bool("progress", own.get("progress", "true")))
    if estimate.runs:
        costs.record_measured(output_dir, time.perf_counter() - tick, summary.trained)
    finals_done = any(output_dir.glob(f"{data.task}/*/seed*/result.json"))
    status = finish(summary, output_dir, own, finals_done, suite)
    if (output_dir / "leaderboard.csv").is_file() and finals_done and not summary.stale:
        plan = report.Plan(suite.name, tuple(suite.experiments), tuple(suite.tasks), tuple(suite.seeds))
        for line in answer_lines(answer_for(output_dir, budget, plan), output_dir):
            print(line)
    return status


def answer_lines(answer: choice.Choice, output_dir: Path) -> list[str]:
    """The answer as the terminal says it, and where ``choice.md`` holds it.

    ``choice.md`` keeps its Markdown; here it is plain text: ``**bold**`` shows as asterisks in a terminal, and a
    command copied with its backquotes runs as a shell command substitution.
    """
    return [f"petl-bench: {plain(answer.paragraph)}", f"petl-bench: written to {output_dir / choice.CHOICE_FILE}"]


def stale_runs(cells: list[protocol.Cell]) -> list[str]:
    """The finished runs of ``cells`` trained with another config than the one planned now, with the difference."""
    from petl.train.config import default_config
    from petl.train.output_dir import check_finished

    runs = [t.run for cell in cells for t in cell.trials]
    for cell in cells:
        if (selection := cell.selection()) is not None:
            runs += cell.finals(selection["chosen"])
    stale = []
    for run in runs:
        if run.is_done():
            try:
                overrides = run.full_overrides()
                if overrides is not None:  # None: its calibrating run is gone, nothing to compare with
                    check_finished(default_config(overrides))
            except ValueError as error:  # a ConfigError naming up to three keys, or a calibration unreadable
                stale.append(str(error))
    return stale


def data_options(overrides: list[str]) -> list[str]:
    """The command line's options naming the data (its place, a dataset's columns): its defaults need them too.

    Other ``data.*`` options (``data.subset``, ``data.augment``) are part of the setup, so they stay out.
    """
    naming = ("data.root=", "data.image_column=", "data.label_column=")
    return [o for o in overrides if o.lstrip("+~").startswith(naming)]


def answer_for(output_dir: Path, budget: choice.Budget, plan: Any = None, configs_dir: Any = None) -> choice.Choice:
    """The answer for a results folder of own data (its leaderboard rebuilt from its runs), written to choice.md.

    ``plan`` (:class:`petl.bench.report.Plan`): the suite's experiments, task and seeds, so a row short of a
    seed is not complete; ``None``: the seeds most cells of the board have.
    """
    records = report.collect(output_dir)
    experiments = sorted({r.experiment for r in records})
    board = report.aggregate(
        records,
        output_dir,
        report.published_names(experiments, configs_dir),
        report.family_names(experiments, configs_dir),
        plan,
    )
    answer = choice.choose(board, budget, own_data.read_record(output_dir))
    estimate = costs.read_estimate(output_dir)
    measured = (estimate or {}).get("measured_seconds")
    choice.write_choice(output_dir, answer, estimate, measured, report.figures_drawn(output_dir))
    return answer
