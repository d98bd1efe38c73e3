"""petl-run: train one PETL method on one task from the command line (Hydra).

    petl-run method=lora
    petl-run method=lora method.rank=4 data=mini/dsprites_ori train.epochs=20 seed=1
    petl-run model=vit_base_patch16_224.augreg2_in21k_ft_in1k data=vtab/cifar100 train.precision=bf16
    petl-run --multirun method=lora,adapter,vpt seed=0,1,2
    petl-run experiment=vpt_deep data=mini/digits       # a preset of configs/experiments/
    accelerate launch -m petl.run method=lora ...      # DDP on every GPU of the machine

``experiment=NAME`` stands for the overrides of the experiment preset NAME (``configs/experiments/``,
found by :func:`petl.presets.configs_dir`; ``petl-bench list`` shows them): its method and options, its
``train``/``model`` settings and an ``output_dir`` under its name, placed before the rest of the command
line, which wins (``experiment=vpt_deep method.num_tokens=50``).  It cannot be combined with
``method=``, and takes one name (sweep other keys with ``--multirun``; a suite of experiments is
``petl-bench``'s job).

Bad input (an unknown method, dataset, model or key; a value of the wrong type or out of range)
exits with status 2 and one line naming the key and what is valid; a run that cannot complete
(non-finite loss, unreachable data, a full disk, output_dir held by another run) exits with status 1
and one line.  Bad input is checked for every job of a sweep before the first one starts, and so is a sweep
whose jobs would train other runs into one ``output_dir``.  Ctrl-C exits
with 130 and SIGTERM (a job scheduler's time limit, ``kill``) with 143, in one line saying how to resume (or,
before the first epoch finished, that the same command starts the run over; on a finished run being checked, that
the same command returns it); the finished epochs are kept and the folder's lock released.
``--debug`` (or ``HYDRA_FULL_ERROR=1``) shows the traceback instead of the line.

A single run is composed and checked once and run directly; sweeps, and command lines that set
Hydra's own options, go through Hydra's app runner.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import logging.config
import os
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from petl import presets
from petl.cli.args import Parser, entry_point, exit_statuses, hydra_parser, plain
from petl.utils.errors import RUN_ERROR, USAGE_ERROR, ConfigError, RunError, UnreachableError, exit_status

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from petl.train.cache import CacheOptionError

# Hydra, torch and timm are imported where they are used, so that ``petl-run --help`` answers without them.

PROG = "petl-run"

# Sweeps larger than this are checked on their first jobs only; every job still checks itself.
MAX_CHECKED_JOBS = 64

# ``experiment=NAME``: an experiment preset's overrides in place of this one (see expand_experiment).
EXPERIMENT_KEY = "experiment"

# Errors of the jobs of a local sweep (Hydra's basic launcher runs them in this process).
_failed_jobs: list[str] = []

# The folder and config of the run this process trains now (a single run's from the start; a local sweep's job's
# once it starts): Ctrl-C's line says what the folder kept (_interrupted_line).
_training: tuple[Path, DictConfig] | None = None

# Show tracebacks instead of one line (``--debug``, or Hydra's own HYDRA_FULL_ERROR=1).
DEBUG_FLAG = "--debug"
_debug = False


def _error(message: str, alike: str = "launch") -> None:
    """Write petl-run's error line from the processes of a launch that say it.

    Args:
        message: the line's text.
        alike: which processes meet the fault alike: ``launch``, all of them (bad input): the first says it, or it
            would print once per GPU; ``machine``, all on one machine (its data or weights out of reach,
            :class:`petl.utils.errors.UnreachableError`): the first of each machine says it; ``""``, one process
            alone (a non-finite loss on its shard): that process says it too, or the launch ended on the others'
            lost connection with no word of why.

    """
    from petl.utils.distributed import is_local_main_process, is_main_process

    # One write of line and newline: print's two writes let another process's output in between.
    if is_main_process():
        sys.stderr.write(f"{PROG}: error: {message}\n")
    elif not alike or (alike == "machine" and is_local_main_process()):
        sys.stderr.write(f"{PROG}: error: rank {os.environ.get('RANK')}: {message}\n")


def _job_overrides(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override list of every job the command line would launch (the first MAX_CHECKED_JOBS).

    Expanded as Hydra's basic sweeper does (the cartesian product of the sweeps, a later override
    of a key replacing an earlier one), through the public ``Override`` API.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not multirun:
        return [overrides]
    final: dict[str, list[str]] = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if not override.is_sweep_override():
            final[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            final[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        # Sweep kinds only other sweepers understand (intervals for Optuna...): check the fixed part.
    return [list(job) for job in itertools.islice(itertools.product(*final.values()), MAX_CHECKED_JOBS)]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def expand_experiment(overrides: Sequence[str]) -> list[str]:
    """Replace ``experiment=NAME`` by the experiment's overrides, placed first so the others win.

    Besides :meth:`petl.presets.Experiment.overrides` (the same strings a ``petl-bench`` sweep
    uses), the default ``output_dir`` gets the experiment's name in place of the method's, so two
    experiments of one method (``vpt_shallow``, ``vpt_deep``) do not share a folder.

    Raises:
        ConfigError: an unknown experiment (listing the known ones), a malformed file, ``method=``
            beside it, or more than one experiment.

    """
    from petl.train import config

    chosen = [o for o in overrides if _key(o) == EXPERIMENT_KEY]
    if not chosen:
        return list(overrides)
    name = chosen[0].split("=", 1)[1] if "=" in chosen[0] else ""
    if len(chosen) > 1 or "," in name or "(" in name:
        raise ConfigError(
            "experiment= takes one name: run one petl-run per experiment, or a suite of them with petl-bench "
            "(--multirun sweeps the other keys)"
        )
    rest = [o for o in overrides if o is not chosen[0]]
    if any(_key(o) in ("method", "method.name") for o in rest):
        raise ConfigError(
            f"experiment={name} sets the method: drop method= (its options may follow, e.g. method.rank=4)"
        )
    try:
        expanded = presets.experiment_overrides(name)
    except (ValueError, FileNotFoundError) as error:
        raise ConfigError(str(error)) from None
    default_dir = next(f.default for f in dataclasses.fields(config.RunConfig) if f.name == "output_dir")
    output_dir = presets.format_value(default_dir.replace("${method.name}", name))
    return [*expanded, f"output_dir={output_dir}", *rest]


def experiment_sources(overrides: Sequence[str]) -> dict[str, str]:
    """The keys ``experiment=NAME`` in ``overrides`` (as typed) sets and they do not, each with ``experiment=NAME``.

    A refusal of such a value then says where it came from: the user never typed it.  :func:`expand_experiment` has
    checked the name.
    """
    chosen = next((o for o in overrides if _key(o) == EXPERIMENT_KEY), None)
    if chosen is None:
        return {}
    name = chosen.split("=", 1)[1]
    typed = {_key(o) for o in overrides}
    return {_key(o): chosen for o in presets.experiment_overrides(name) if _key(o) not in typed}


def check_command_line(
    overrides: Sequence[str], multirun: bool = False, sources: dict[str, str] | None = None
) -> list[DictConfig]:
    """Compose and check every job of a command line before Hydra starts any of them.

    Args:
        overrides: the command line's overrides, an experiment's expanded (:func:`expand_experiment`).
        multirun: ``--multirun``: each job of the sweep is checked.
        sources: the keys an experiment set (:func:`experiment_sources`), named so in a refusal.

    Returns:
        The composed, checked config of each job checked (a single run's is the one it runs).

    Raises:
        ConfigError: the first problem found, as one line (naming the job of a sweep).

    """
    from hydra.errors import HydraException

    from petl.train import config
    from petl.train.cache import CacheOptionError

    try:
        jobs = _job_overrides(list(overrides), multirun)
    except HydraException as error:
        raise ConfigError(config.explain(error, overrides)) from None
    checked = []
    refused: list[tuple[list[str], CacheOptionError]] = []
    for job in jobs:
        try:
            checked.append(config.default_config(job, sources))
        except ConfigError as error:
            if isinstance(error, CacheOptionError) and len(jobs) > 1:
                refused.append((job, error))  # every such job is named at once, once the others are checked
                continue
            where = f" (in job {' '.join(job)})" if multirun and len(jobs) > 1 else ""
            raise ConfigError(f"{error}{where}") from None
    if refused:
        raise ConfigError(_cache_refusal(jobs, refused))
    if len(checked) > 1:
        _check_own_folders(jobs, checked)
    return checked


def _check_own_folders(jobs: list[list[str]], checked: list[DictConfig]) -> None:
    """Refuse a sweep of which two jobs train other runs into one ``output_dir``.

    The default folder names the data, model, method and seed only: a sweep over ``train.lr`` put every job there,
    and each after the first failed on the folder the first had filled, once the first had trained.  Jobs of one run
    (a neutral key swept) share a folder as a resume does.

    Raises:
        ConfigError: naming the folder, the two jobs' overrides and the keys that differ.

    """
    from omegaconf import OmegaConf

    from petl.train import config
    from petl.train import output_dir as folder

    first: dict[str, tuple[list[str], dict[str, Any]]] = {}
    for job, cfg in zip(jobs, checked, strict=True):
        # train.precision as given: resolving auto would ask accelerate for the device in the launching process.
        resolved = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(resolved, dict)
        out = str(resolved["output_dir"])
        if out not in first:
            first[out] = (job, resolved)
            continue
        other_job, other = first[out]
        difference = folder.config_difference(other, resolved)
        if difference:
            differ = [o for o in job if o not in other_job] or job
            key = differ[0].split("=", 1)[0].lstrip("+~")
            # A group's choice by its name (a folder per method); another key by its last part and value (lr0.01).
            part = f"${{{key}.name}}" if key in config.CONFIG_GROUPS else f"{key.split('.')[-1]}${{{key}}}"
            raise ConfigError(
                f"--multirun: jobs {' '.join(o for o in other_job if o not in job)} and {' '.join(differ)} would both "
                f"write to output_dir {out} ({difference}): put the swept keys in it, e.g. "
                f"'output_dir={out}/{part}'"
            )


def _cache_refusal(jobs: list[list[str]], refused: list[tuple[list[str], CacheOptionError]]) -> str:
    """One line naming each job of a sweep where ``train.cache_features=false`` cannot act, by its swept values."""
    common = set.intersection(*(set(job) for job in jobs))
    named = [f"{' '.join(o for o in job if o not in common)}: {error.reason}" for job, error in refused]
    todo = "drop it" if len(refused) == len(jobs) else "drop it, or sweep those jobs apart without it"
    # A larger sweep is checked on its first jobs only (_job_overrides): their count is not the sweep's.
    among = f"the first {len(jobs)}" if len(jobs) == MAX_CHECKED_JOBS else f"the {len(jobs)}"
    return (
        f"train.cache_features=false cannot act in {len(refused)} of {among} jobs, where no features are "
        f"cached either way: {'; '.join(named)}; {todo}"
    )


def _task(cfg: DictConfig, checked: bool = False) -> dict[str, Any] | None:
    """One run; errors become one line and an exit status.

    Args:
        cfg: the run's config.
        checked: ``cfg`` is the one :func:`check_command_line` composed and checked.

    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from petl.train import runner
    from petl.utils.distributed import is_main_process

    global _training
    _training = (Path(cfg.output_dir), cfg)  # the folder resolved here, in the job
    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    multirun = hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN
    # Hydra's basic launcher runs a sweep's jobs in this process; others (submitit...) elsewhere.
    in_process = multirun and "BasicLauncher" in str(hydra_cfg.launcher.get("_target_", ""))
    try:
        result = runner.run(cfg, checked=checked)
    except (ConfigError, runner.RunError, OSError, ValueError) as error:
        if _debug:
            raise
        status = exit_status(error)
        # OSError/ValueError: faults the run did not foresee (a bad file met mid-training...);
        # one line names them, the checkpoint of finished epochs is on disk.
        known = isinstance(error, (ConfigError, runner.RunError))
        message = str(error) if known else f"{type(error).__name__}: {error} ({DEBUG_FLAG} shows the traceback)"
        alike = "launch" if status == USAGE_ERROR else "machine" if isinstance(error, UnreachableError) else ""
        _error(message, alike)
        if in_process:
            # Let the other jobs of the sweep run; main() reports the failures at the end.
            _failed_jobs.append(message)
            _training = None  # ended: Ctrl-C before the next job's start is not this one's
            return None
        if multirun:
            # A remote job must fail visibly to its launcher (the line above is in its log).
            raise RuntimeError(message) from None
        raise SystemExit(status) from None
    _training = None
    if is_main_process():
        print(runner.summary_line(result) + f"  -> {cfg.output_dir}", flush=True)
    return result


def _hydra_main() -> None:
    """Hydra's app runner over :func:`_task`; it reads the command line from ``sys.argv``."""
    import hydra

    hydra.main(version_base="1.3", config_path="pkg://petl.conf", config_name="config")(_task)()


def hydra_help() -> str:
    """Hydra's own app help of the default config, as ``petl-run --help`` printed it before it had its own.

    :mod:`petl.cli.run_choices` is generated from it, and the tests compare :mod:`petl.cli.run_help` with it.
    Registers the config schema, so it loads torch and timm; run it in a fresh process for the default ``model``
    group (models are registered as the command lines of a process name them).
    """
    from petl.train import config

    config.register_configs()
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
        _run_hydra(["--help"])
    return shown.getvalue()


def _needs_hydra(args: argparse.Namespace) -> bool:
    """Whether a command line uses something only Hydra's app runner does (sweeps, hydra.* settings)."""
    hydra_flags = ("cfg", "config_path", "config_name", "config_dir", "experimental_rerun", "package", "resolve")
    return (
        args.multirun
        or any(getattr(args, flag, None) for flag in hydra_flags)
        or any("hydra" in override for override in args.overrides)
    )


def _configure_logging() -> None:
    """Set up the job logging of conf/hydra/job_logging/petl.yaml, as Hydra does for its app."""
    text = resources.files("petl.conf").joinpath("hydra/job_logging/petl.yaml").read_text(encoding="utf-8")
    logging.config.dictConfig(yaml.safe_load(text))


@entry_point(PROG, DEBUG_FLAG)
def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``petl-run`` (and ``python -m petl.run``).

    A single run is composed and checked once, then run directly; sweeps and command lines that
    set Hydra's own options go through Hydra's app runner, each job of a sweep checked first.
    """
    global _debug
    argv = list(sys.argv[1:] if argv is None else argv)
    _debug = DEBUG_FLAG in argv or os.environ.get("HYDRA_FULL_ERROR") == "1"
    argv = [arg for arg in argv if arg != DEBUG_FLAG]
    from petl.utils.distributed import is_main_process  # light: no torch

    # Only one process of a multi-GPU launch speaks, or every error would print once per GPU.
    quiet = not is_main_process()
    # Flags anywhere: parsed intermixed, then handed to Hydra's app runner flags first (its parser wants them so).
    # A bad flag is one line and exit 2, as other bad input: Hydra's own parser never sees a line this one refused.
    # Even with --debug: the traceback would be argparse's.
    with exit_statuses(PROG, failure=(), quiet=quiet):
        parser = hydra_parser(PROG)
        args = parser.parse_intermixed_args(argv)
        _check_modes(parser, args)
    if args.help and not args.overrides:
        from petl.cli.run_help import fast_help

        print(plain(fast_help(PROG, __doc__)))
        raise SystemExit  # status 0, as argparse after --help
    from petl.train import config

    flags = list(argv)
    for override in args.overrides:
        flags.remove(override)
    if args.info:
        flags = _info_as_one_word(flags, args.info)
    # --debug: bad input found while composing the command line shows its traceback too, as a run's does.
    with exit_statuses(PROG, usage=(ConfigError,), failure=(), debug=_debug, quiet=quiet):
        overrides = expand_experiment(args.overrides)
        sources = experiment_sources(args.overrides)
        argv, args.overrides = [*flags, *overrides], overrides
        config.register_configs()
        config.register_models_in(args.overrides)
        # These only print, so nothing needs checking.
        informational = any(
            getattr(args, flag, None) for flag in ("help", "hydra_help", "shell_completion", "info", "version")
        )
        try:
            checked: list[DictConfig] = (
                [] if informational else check_command_line(args.overrides, args.multirun, sources)
            )
        except RunError as error:  # data that cannot be reached here (a hub id offline): not bad input, exit 1
            if _debug:
                raise
            # Met alike by every process (of a machine, where the data is out of its reach): not once per GPU.
            _error(str(error), "machine" if isinstance(error, UnreachableError) else "launch")
            raise SystemExit(RUN_ERROR) from None
    _failed_jobs.clear()
    global _training
    _training = (Path(checked[0].output_dir), checked[0]) if len(checked) == 1 and not args.multirun else None
    resumes = not checked or checked[0].resume  # resume=false would move the kept epochs aside

    def interrupted() -> str:
        return _interrupted_line(resumes)

    with exit_statuses(PROG, failure=(), interrupted=interrupted, debug=_debug, quiet=quiet):
        if checked and not _needs_hydra(args):
            _configure_logging()
            _task(checked[0], checked=True)
        else:
            _run_hydra(argv)
    if _failed_jobs:
        _error(f"{len(_failed_jobs)} job(s) of the sweep failed (see above)")
        raise SystemExit(RUN_ERROR)


def _interrupted_line(resume: bool) -> str:
    """Ctrl-C's line: what the run being trained kept, and what the same command does with it.

    A finished run (its ``result.json``; with ``resume`` on, the default) is what the same command returns, after
    checking its config and data once more: Ctrl-C may come during that check, which decodes a folder of photos.  A
    run keeps a checkpoint as each epoch ends.  Interrupted before its first, its folder holds none (its
    ``config.yaml``, perhaps ``metrics.jsonl``), or, under ``resume=false`` before the run set the earlier one aside,
    the earlier run's of another config, which ``resume=true`` would refuse; the same command trains it from its
    first epoch: :func:`petl.train.output_dir.check_output_dir` rewrites what such a run left.
    """
    from petl.store import files

    out = None if _training is None else _training[0]
    if out is not None and resume and (out / files.RESULT_FILE).is_file():
        return f"error: interrupted; output_dir {out} holds a finished run: the same command returns its result"
    kept = out is not None and (out / files.CHECKPOINT_FILE).is_file()
    if _training is not None and (not kept or not resume and _kept_for_another_config(*_training)):
        return (
            "error: interrupted before the run's first epoch finished, so no epoch is kept: the same command trains "
            "it from the start"
        )
    again = "the same command resumes" if resume else "run it again with resume=true to resume"
    return f"error: interrupted; {again} from the last finished epoch"


def _kept_for_another_config(out: Path, cfg: DictConfig) -> bool:
    """Whether ``out``'s checkpoint was trained with another config than ``cfg`` (its ``config.yaml``'s).

    An unreadable ``config.yaml`` counts as another config's (``resume=true`` refuses it too); a ``cfg`` that does
    not resolve here (an interpolation of Hydra's, out of its job) as this one's: the line says what it did before it
    compared.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from petl.store import files
    from petl.train import output_dir as folder

    try:
        recorded = files.read_config(out)
    except files.DamagedFileError:
        return True
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException:
        return False
    assert isinstance(resolved, dict)
    return bool(folder.config_difference(recorded, resolved))


def _check_modes(parser: Parser, args: argparse.Namespace) -> None:
    """Refuse two of Hydra's modes on one line, and ``--resolve`` without ``--cfg``, as a bad flag is refused.

    Hydra takes one of ``--run``, ``--multirun``, ``--cfg``, ``--info`` and ``--shell-completion`` at a time and
    ``--resolve`` beside ``--cfg`` alone, and raises a ValueError for anything else once it has started: a
    traceback and exit 1 (``petl-run --info -m method=lora``), after the sweep's jobs were checked.  Help answers
    first, as Hydra's does.
    """
    if args.help or args.hydra_help:
        return
    given = {
        "--run": args.run,
        "--multirun": args.multirun,
        "--cfg": args.cfg is not None,
        "--info": args.info is not None,
        "--shell-completion": args.shell_completion,
    }
    modes = [flag for flag, on in given.items() if on]
    if len(modes) > 1:
        parser.error(f"{' and '.join(modes)} cannot be given together: Hydra takes one of {', '.join(given)}")
    if args.resolve and args.cfg is None:
        parser.error("--resolve acts with --cfg only (it resolves the config printed): give --cfg job beside it")


def _info_as_one_word(flags: list[str], topic: str) -> list[str]:
    """``flags`` with ``--info`` (``-i``) and its topic as one word, ``--info=TOPIC``.

    Hydra is handed the flags before the overrides, and ``--info``'s topic is optional: a bare ``--info`` written
    after the overrides (``petl-run method=lora --info``) would take the first of them for its topic there, and
    Hydra would print its usage and an invalid choice.
    """
    out: list[str] = []
    i = 0
    while i < len(flags):
        if flags[i] in ("--info", "-i"):
            out.append(f"--info={topic}")
            i += 2 if flags[i + 1 : i + 2] == [topic] else 1  # the topic given as the next word goes with it
        else:
            out.append(flags[i])
            i += 1
    return out


def _run_hydra(argv: list[str]) -> None:
    from hydra.core.global_hydra import GlobalHydra

    saved_argv = sys.argv
    # hydra.main reads the command line from sys.argv.
    sys.argv = [saved_argv[0] if saved_argv else PROG, *argv]
    try:
        _hydra_main()
    finally:
        sys.argv = saved_argv
        # hydra.main leaves its global state set (a process normally exits here); callers that
        # run petl-run in-process (tests, notebooks) get a clean slate back.
        GlobalHydra.instance().clear()


if __name__ == "__main__":
    main()
