"""``petl-bench``: run a benchmark suite, build its leaderboard, or time the methods.

Usage::

    petl-bench [run] suite=mini [methods=linear,lora] [tasks=mini/digits] [seeds=0,1]
               [output_dir=runs/bench/mini] [configs_dir=...] [report=true] [dry_run=true | --dry-run]
               [train.epochs=5 model.drop_path=0.1 data.root=... ...]
    petl-bench [run] suite=choose data=folder|hf data.root=PATH [model=...] [budget.params=1M]
               [budget.train_seconds=600] [--yes]   (your own images: cost first, then which method; docs/choose.md)
    petl-bench report RESULTS_DIR [out=DIR] [configs_dir=DIR] [suite=NAME]
    petl-bench compare RESULTS_A RESULTS_B [suites=NAME_A,NAME_B] [out=FILE [overwrite=true]]  (two boards' orderings)
    petl-bench speed [model=...] [model.kwargs.depth=2 ...] [img_size=N] [batch=32] [steps=10] [warmup=3]
                     [rounds=10] [infer_batch=1] [infer_steps=100] [device=cpu|cuda] [tf32=true] [methods=...]
                     [options_for=lora] [options=grad_ckpt,compile,bf16] [inprocess=true] [out=FILE]
    petl-bench params suite=vtab1k [methods=...] [model=...]   (parameter counts vs the published ones)
    petl-bench commands suite=mini methods=lora,vpt_deep [hydra/launcher=submitit_slurm ...]
               (prints petl-run --multirun lines; a suite that selects on val, or NOAH, is refused)
    petl-bench list [suite=NAME]   (suites and experiments; with suite=: its experiments, one a line, in order)

Bad input (a run or commands without suite=, an unknown suite or key, a malformed YAML file, a results folder without
results, suite= naming a suite whose backbone its runs did not train, compare on boards of different tasks, out= empty,
inside a run folder or where nothing can be written; for run and commands, before any run, an experiment, search, task
or command-line key or value no run config takes, named by its file, train.cache_features=false where runs would cache
nothing either way (every experiment and task named), methods=, tasks= or seeds= listing nothing, a name or seed
twice or a negative seed, and budget.params=, budget.train_seconds= or --yes without data=, which only a run on your
own images reads; for speed, before any model is built, an unknown model= or one petl refuses
(a distilled DeiT), a model.kwargs.KEY the model does not take, an img_size= the model ignores (a NaFlexVit), a count
out of its range, steps= below rounds=, options= without options_for=, a device other
than cpu or a CUDA GPU torch sees, tf32= on a CPU, inprocess= on a GPU) exits with status 2 and one line naming the
file or value; a sweep with failed runs exits with 1; Ctrl-C with 130 and SIGTERM (a job scheduler's time limit)
with 143, in one line saying so (finished runs are kept, an interrupted run resumes from its last epoch, or, stopped
before its first epoch ended, trains from the start: run the same command again). ``--debug`` shows the traceback.

Arguments are Hydra-style ``key=value``; a yes/no key may be written as a flag (``--dry-run`` is
``dry_run=true``, ``--yes`` is ``yes=true``), and a key that is neither petl-bench's nor a run config's is
refused before anything runs, listing both.  Keys the sweep does not know (``train.*``, ``model.*``,
``data.root``...) pass through to ``petl.run.default_config`` after the suite's and experiment's own
overrides, so the command line wins.  Suites and experiments come from petl's top-level ``configs/``
folder (installed as ``petl.configs``); ``configs_dir=DIR`` (formerly ``benchmarks_dir=``) points at another.
A dry run marks ``stale`` a finished or interrupted run whose folder holds another config (an edited suite):
the sweep fails it, in one line, and trains or resumes nothing there.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

from petl.cli.args import entry_point, exit_statuses
from petl.utils.errors import USAGE_ERROR

PROG = "petl-bench"
DEBUG_FLAG = "--debug"


def _one_line_warning(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None):
    # A skipped result.json is worth one line naming it, not the source line that warned.
    print(f"{PROG}: warning: {message}", file=sys.stderr if file is None else file)


@entry_point(PROG, DEBUG_FLAG)
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``petl-bench``: errors are one line and an exit status (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in args
    args = [a for a in args if a != DEBUG_FLAG]
    usage = (ValueError, FileNotFoundError)
    with exit_statuses(PROG, usage=usage, failure=(Exception,), interrupted=_interrupted_line, debug=debug):
        try:
            with warnings.catch_warnings():
                if not debug:
                    warnings.showwarning = _one_line_warning
                return _dispatch(args)
        except SystemExit as exit_:
            if debug or not isinstance(exit_.code, str):
                raise
            print(_as_error(exit_.code), file=sys.stderr)  # an argument error, already one line
            raise SystemExit(USAGE_ERROR) from None


def _interrupted_line() -> str:
    """Ctrl-C's line, worded when it comes: whether the run being trained kept an epoch (sweep.interrupted_line)."""
    sweep = sys.modules.get("petl.bench.sweep")  # not imported: no run was trained (--help, an argument error)
    if sweep is None:
        return "error: interrupted; run the same command again to go on (finished runs are kept)"
    return sweep.interrupted_line()


def _as_error(line: str) -> str:
    """An argument error's line (``petl-bench: unknown key ...``) as every error line reads: ``PROG: error: ...``."""
    head, sep, rest = line.partition(": ")
    if not sep or not head.startswith(PROG) or rest.startswith("error: "):
        return line
    return f"{head}: error: {rest}"


def _dispatch(args: list[str]) -> int:
    # --help anywhere, as every petl command takes it: `petl-bench speed --help` was refused as a key=value.
    if any(a in ("-h", "--help") for a in args) or args[:1] == ["help"]:
        from petl.cli.args import plain

        print(plain(__doc__))
        return 0
    command = args.pop(0) if args and "=" not in args[0] else "run"
    # Imported after --help: the commands load the sweep, the report and (for a run) torch.
    from petl.bench.commands import (
        cmd_commands,
        cmd_compare,
        cmd_list,
        cmd_params,
        cmd_report,
        cmd_run,
        cmd_speed,
    )

    commands = {
        "run": cmd_run,
        "report": cmd_report,
        "compare": cmd_compare,
        "list": cmd_list,
        "commands": cmd_commands,
        "speed": cmd_speed,
        "params": cmd_params,
    }
    if command not in commands:
        raise SystemExit(f"petl-bench: unknown command {command!r}; use {', '.join(commands)}")
    return commands[command](args)


if __name__ == "__main__":
    sys.exit(main())
