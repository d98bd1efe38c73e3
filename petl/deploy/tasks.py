"""What names a :class:`petl.MultiTask`'s tasks: the checks of the names and of the run folders it is given (and the
CLIs' run folders given twice).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def check_task_names(tasks: Mapping[Any, Any]) -> None:
    """Refuse a task named by an integer, or two keys that name one task (``1`` and ``'1'``).

    forward reads an integer task id as an index into the names, so task 1 would answer for the task at position 1;
    the names are the keys as strings, so two keys with one string would serve one of them.
    """
    wrong = next((name for name in tasks if isinstance(name, numbers.Integral)), None)
    if wrong is not None:
        raise ValueError(
            f"task name {wrong!r} is an integer: name tasks by strings ({str(wrong)!r}); an integer "
            "task id given to forward is an index into the names"
        )
    names = [str(name) for name in tasks]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise ValueError(f"task name {twice!r} is given twice: give each task one name")


def named_runs(runs: Iterable[str | Path] | Mapping[str, str | Path]) -> dict[str, str | Path]:
    """Task name -> run folder for :meth:`petl.MultiTask.from_runs` (a list's folders are named by their paths).

    Raises:
        ValueError: one path where a list is taken, something other than a path, no run, or one run folder listed
            twice (its tasks would be one: a dict names two tasks for it).

    """
    if isinstance(runs, str | Path):  # a string is a sequence too: of one-letter "folders"
        raise ValueError(f"MultiTask.from_runs takes a list of run folders, got one path: write [{str(runs)!r}]")
    if isinstance(runs, Mapping):
        check_task_names(runs)
    else:  # read once: a generator (Path.glob's) is checked below and then named
        runs = list(runs)
    folders = runs.values() if isinstance(runs, Mapping) else runs
    wrong = next((run for run in folders if not isinstance(run, str | os.PathLike)), None)
    if wrong is not None:  # a petl.load_run answer, say: pathlib would fail on it without saying what to give
        where = f": give its folder ({wrong.run_dir})" if isinstance(getattr(wrong, "run_dir", None), Path) else ""
        raise ValueError(f"MultiTask.from_runs takes run folders, got a {type(wrong).__name__}{where}")
    if isinstance(runs, Mapping):
        tasks = {str(name): folder for name, folder in runs.items()}
    else:
        # One folder twice (or spelt twice: runs/a, runs/a/) served one task, or two of one run, where two were asked.
        seen: dict[str, str | Path] = {}
        for run in runs:
            first = seen.get(os.path.realpath(run))
            if first is None:
                seen[os.path.realpath(run)] = run
            else:
                spelt = "" if str(first) == str(run) else f" (as {str(first)!r} and {str(run)!r})"
                raise ValueError(
                    f"run folder {run} is given twice{spelt}: give each run once, or a dict to name two tasks of it"
                )
        tasks = {str(run): run for run in runs}
    if not tasks:
        raise ValueError("MultiTask.from_runs needs at least one run folder")
    return tasks


def given_once(folders: Iterable[Path]) -> tuple[list[Path], list[Path]]:
    """Each run folder once, as first given, and the later givings of one already given (however spelt: ``runs/a``,
    ``runs/a/``, ``./runs/../runs/a``, its absolute path), which petl-predict and petl-serve note and leave out.
    """
    first: dict[Path, Path] = {}
    again = [folder for folder in folders if first.setdefault(folder.resolve(), folder) is not folder]
    return list(first.values()), again
