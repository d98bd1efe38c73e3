"""Suites: small YAML files that hold a benchmark protocol as differences from petl's defaults.

Experiments (a method and its options, ``configs/experiments/``) are read by :mod:`petl.presets`, which
``petl-run experiment=NAME`` uses too; their names are re-exported here for petl.bench's modules.

A suite is a whole protocol: experiments (a list, ``all``, or the name of a list in
``configs/experiment_lists.yaml``, where a list several suites run is stated once), tasks (a list, or the name of
a list in ``configs/task_lists.yaml``, likewise), the final runs' seeds
and split, the ``train:`` / ``model:`` / ``data:`` overrides (backbone, recipe, augmentation) and, optionally,
the ``search:`` space selected on val (see :mod:`petl.bench.protocol`).  Everything becomes Hydra override
strings, the same language ``petl-run`` speaks, so a sweep run here and a ``petl-run`` command compose identical
configs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petl.data import TRAIN_VAL, TRAINING_SPLITS
from petl.presets import (
    SEARCH_ROOTS,
    SWEEP_OWNED,
    Experiment,
    configs_dir,
    flatten,
    format_value,
    list_experiments,
    load_experiment,
    override,
    preset_names,
    read_space,
    read_yaml,
    read_yaml_mapping,
    to_overrides,
)
from petl.utils.random import MAX_SEED

# Experiments live in petl.presets (petl-run reads them too); petl.bench's modules import them from here.
__all__ = [
    "ALL",
    "FINAL_SPLIT",
    "Experiment",
    "Suite",
    "configs_dir",
    "experiment_lists",
    "format_value",
    "list_experiments",
    "list_suites",
    "load_experiment",
    "load_suite",
    "override",
    "task_lists",
    "to_overrides",
]

# A suite may set `train`, `model` and `data` options (augmentation...), but `data.name`, `data.split`,
# `seed` and `output_dir` belong to the sweep (SWEEP_OWNED).
SUITE_GROUPS = ("train", "model", "data")
# The split the final runs train on when a suite searches (model selection used train800 / val200).
FINAL_SPLIT = TRAIN_VAL
# `experiments: all` in a suite: every experiment file plus every registered method no file covers.
ALL = "all"
# `experiments: <name>` in a suite: a list of this file (beside suites/), the one home of a list several suites run.
EXPERIMENT_LISTS = "experiment_lists.yaml"
# `tasks: <name>` in a suite: a list of this file, the one home of a task list several suites run.
TASK_LISTS = "task_lists.yaml"


@dataclass(frozen=True)
class Suite:
    """A benchmark protocol: experiments × tasks × seeds with shared overrides, and optionally a search.

    Attributes:
        name: the file stem.
        experiments: experiment names (files, or registered methods for their registry defaults).
        tasks: petl dataset names.
        seeds: seeds of the runs that are reported (the final runs, when the suite searches).
        groups: ``train`` / ``model`` / ``data`` overrides: backbone, recipe, augmentation.
        description: one line for humans.
        search: the space selected on val, ``{"train.lr": [1e-3, 1e-2], ...}``; empty: no selection,
            every run trains once per seed on ``data.split``'s default (train800), as before.
        search_seed: the one seed every selection trial trains with.
        final_split: the split the reported runs train on; ``None`` (only without a search) keeps
            ``data.split``'s default, train800.
        per_task: ``{experiment: {task: {"train.lr": 0.005, ...}}}``: settings a reference published per
            task (a "reproduce V-PETL" preset); they pin their keys out of a search.
        per_experiment: ``{experiment: {"method.search_epochs": 100, ...}}``: one experiment's settings in
            this suite only (NOAH's search budget scaled to the suite's epochs), after the experiment's own
            and before ``per_task``; they too pin their keys out of a search.
        pinned_trial: an experiment that pins every searched key (full fine-tuning's ``train.lr``) still
            gets its one trial on train800 / val200: nothing to select, but its val curve shows whether the
            schedule converged, at one more run per task.  Off: such a cell goes straight to its finals.
        require_learning: selection passes over grid points at which training did not learn
            (:mod:`petl.train.learning`): a trial that did not learn ranks after every trial that did, and a
            point whose final runs include one that did not learn is set aside for the cell (its finals move to
            ``unstable/<point>/``) while the next point's finals train (:mod:`petl.bench.protocol`).

    """

    name: str
    experiments: list[str]
    tasks: list[str]
    seeds: list[int]
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    description: str = ""
    search: dict[str, list[Any]] = field(default_factory=dict)
    search_seed: int = 0
    final_split: str | None = None
    per_task: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    pinned_trial: bool = False
    per_experiment: dict[str, dict[str, Any]] = field(default_factory=dict)
    require_learning: bool = False

    def experiment_overrides(self, experiment: str) -> list[str]:
        """This suite's own settings of one experiment (``per_experiment``), as Hydra overrides."""
        return [override(k, v) for k, v in self.per_experiment.get(experiment, {}).items()]

    def task_overrides(self, experiment: str, task: str) -> list[str]:
        """The suite's settings of one experiment on one task (``per_experiment``, then ``per_task``)."""
        per_task = [override(k, v) for k, v in self.per_task.get(experiment, {}).get(task, {}).items()]
        return self.experiment_overrides(experiment) + per_task

    def overrides(self) -> list[str]:
        """Hydra overrides of the suite's protocol (backbone, epochs, augmentation...)."""
        out = []
        for group, values in self.groups.items():
            values = dict(values)
            # The backbone is a config group choice (`model=<name>`), as on petl-run's command line.
            if group == "model" and "name" in values:
                out.append(f"model={format_value(values.pop('name'))}")
            out += to_overrides(group, values)
        return out

    def space_for(self, experiment: Experiment, task: str | None = None) -> dict[str, list[Any]]:
        """The grid one experiment is selected over.

        The suite's space, less the keys the experiment pins (full fine-tuning's lower ``train.lr``), plus
        the experiment's own ``search:`` (which wins for a key both name).  Empty when the suite does not search.
        """
        if not self.search:
            return {}
        pinned = set(self.per_task.get(experiment.name, {}).get(task, {}))
        pinned |= set(self.per_experiment.get(experiment.name, {}))
        space = {k: v for k, v in self.search.items() if k not in experiment.fixed_keys() | pinned}
        space.update(experiment.search)
        # A reference's published per-task value (or the suite's own setting) pins its key out of the
        # experiment's own search too.
        return {k: v for k, v in space.items() if k not in pinned}


def load_suite(name: str, configs: Path) -> Suite:
    """Read ``suites/<name>.yaml``.

    Raises:
        ValueError: an unknown suite (listing the known ones) or a malformed file.

    """
    path = configs / "suites" / f"{name}.yaml"
    if not path.is_file():
        known = preset_names(configs / "suites")
        if not known:  # an empty list after "known:" read as a cut-off line
            raise ValueError(
                f"unknown suite {name!r}: there are no suites in {configs / 'suites'} "
                "(a suite is a NAME.yaml file there)"
            )
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(known)}")
    keys = {"description", "experiments", "tasks", "seeds", "search", "search_seed", "final_split", "per_task"}
    keys |= {"pinned_trial", "per_experiment", "require_learning"}
    keys |= set(SUITE_GROUPS)
    data = read_yaml_mapping(path, keys, SUITE_GROUPS)
    if data.get("experiments") == ALL:
        data["experiments"] = list_experiments(configs)
    elif isinstance(data.get("experiments"), str):
        data["experiments"] = _named_list(path, "experiments", data["experiments"], experiment_lists(configs))
    if isinstance(data.get("tasks"), str):
        data["tasks"] = _named_list(path, "tasks", data["tasks"], task_lists(configs))
    or_names = {"experiments": f" (or `all`, or a list's name in {EXPERIMENT_LISTS})"}
    or_names["tasks"] = f" (or a list's name in {TASK_LISTS})"
    for key in ("experiments", "tasks", "seeds"):
        if not isinstance(data.get(key), list) or not data[key]:
            raise ValueError(f"{path}: `{key}` must be a non-empty list{or_names.get(key, '')}")
        twice = sorted({str(x) for x in data[key] if data[key].count(x) > 1})
        if twice:
            # The same run planned twice: one folder, trained once and counted twice.
            raise ValueError(f"{path}: `{key}` lists {', '.join(twice)} more than once: list each once")
    if not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_SEED for s in data["seeds"]):
        # int() would make 0.5 seed 0 and "1" seed 1 without a word; a word would stop in a bare int() error; a
        # seed petl-run refuses (negative, or past MAX_SEED) would fail each run in its error.log.
        raise ValueError(
            f"{path}: `seeds` must list whole numbers from 0 to {MAX_SEED}, e.g. [0, 1, 2]; got {data['seeds']!r}"
        )
    groups = {g: data[g] for g in SUITE_GROUPS if data.get(g)}
    owned = sorted(set(SWEEP_OWNED) & {k for g, v in groups.items() for k in flatten(g, v)})
    if owned:
        raise ValueError(f"{path}: {', '.join(owned)} are set per run by the sweep (final_split: sets the split)")
    search = read_space(path, data.get("search"))
    if "search" in data and not search:
        # An empty grid (every key commented out) would silently run without selection, on another split.
        raise ValueError(f"{path}: `search` is empty: give keys and values (train.lr: [1.0e-3, 1.0e-2]) or remove it")
    if "search_seed" in data and not search:
        # A value without effect is a bug: the trial seed only acts when the suite selects on val.
        raise ValueError(f"{path}: `search_seed` needs a `search:` space (without one, runs train once per seed)")
    search_seed = data.get("search_seed", 0)
    if not isinstance(search_seed, int) or isinstance(search_seed, bool) or not 0 <= search_seed <= MAX_SEED:
        raise ValueError(
            f"{path}: `search_seed` must be a whole number from 0 to {MAX_SEED}, e.g. 0; got {search_seed!r}"
        )
    final_split = data.get("final_split")
    if final_split is None and search:  # left out, or `final_split:` with no value
        final_split = FINAL_SPLIT
    if final_split is not None and final_split not in TRAINING_SPLITS:
        # Checked here, not after a whole search has been spent on a split no run can train on.
        raise ValueError(f"{path}: final_split {final_split!r}: expected one of {', '.join(TRAINING_SPLITS)}")
    pinned_trial = data.get("pinned_trial", False)
    if not isinstance(pinned_trial, bool):
        raise ValueError(f"{path}: `pinned_trial` must be true or false, got {pinned_trial!r}")
    if pinned_trial and not search:
        raise ValueError(f"{path}: `pinned_trial` needs a `search:` space (without one, nothing is pinned out of it)")
    require_learning = data.get("require_learning", False)
    if not isinstance(require_learning, bool):
        raise ValueError(f"{path}: `require_learning` must be true or false, got {require_learning!r}")
    if require_learning and not search:
        raise ValueError(f"{path}: `require_learning` needs a `search:` space (it acts on the selection)")
    per_task = _read_per_task(path, data.get("per_task") or {}, data["experiments"], data["tasks"])
    per_experiment = _read_per_experiment(path, data.get("per_experiment") or {}, data["experiments"])
    return Suite(
        name,
        [str(e) for e in data["experiments"]],
        [str(t) for t in data["tasks"]],
        [int(s) for s in data["seeds"]],
        groups,
        str(data.get("description", "")),
        search=search,
        search_seed=search_seed,
        final_split=final_split,
        per_task=per_task,
        pinned_trial=pinned_trial,
        per_experiment=per_experiment,
        require_learning=require_learning,
    )


def experiment_lists(configs: Path) -> dict[str, list[str]]:
    """The named experiment lists of ``configs/experiment_lists.yaml`` (none when the file is absent).

    Raises:
        ValueError: a malformed file (naming it): each name must map to a non-empty list of experiment names.

    """
    return _read_lists(configs / EXPERIMENT_LISTS, "experiment")


def task_lists(configs: Path) -> dict[str, list[str]]:
    """The named task lists of ``configs/task_lists.yaml`` (none when the file is absent).

    Raises:
        ValueError: a malformed file (naming it): each name must map to a non-empty list of task names.

    """
    return _read_lists(configs / TASK_LISTS, "task")


def _read_lists(path: Path, what: str) -> dict[str, list[str]]:
    if not path.is_file():
        return {}
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of list names to {what} lists, got {type(data).__name__}")
    for name, listed in data.items():
        reserved = name == ALL and what == "experiment"  # `experiments: all` means every experiment
        if reserved or not isinstance(listed, list) or not listed or not all(isinstance(e, str) for e in listed):
            reason = "`all` means every experiment" if reserved else f"must be a non-empty list of {what} names"
            raise ValueError(f"{path}: {name!r}: {reason}")
    return {str(name): list(listed) for name, listed in data.items()}


def _named_list(path: Path, key: str, name: str, lists: dict[str, list[str]]) -> list[str]:
    if name not in lists:
        home = EXPERIMENT_LISTS if key == "experiments" else TASK_LISTS
        known = ", ".join([ALL, *lists] if key == "experiments" else lists) or "none"
        raise ValueError(f"{path}: {key}: {name!r} is not a list of {path.parent.parent / home}; known: {known}")
    return lists[name]


def _read_per_task(path: Path, raw: Any, experiments: list[Any], tasks: list[Any]) -> dict[str, dict[str, dict]]:
    """Check ``per_task: {experiment: {task: {option.key: value}}}`` against the suite's own lists."""
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: `per_task` must map experiments to tasks to option overrides")
    out: dict[str, dict[str, dict]] = {}
    for experiment, by_task in raw.items():
        if str(experiment) not in map(str, experiments) or not isinstance(by_task, dict):
            raise ValueError(f"{path}: per_task: {experiment!r} is not one of the suite's experiments")
        for task, values in by_task.items():
            if str(task) not in map(str, tasks) or not isinstance(values, dict):
                raise ValueError(f"{path}: per_task.{experiment}: {task!r} is not one of the suite's tasks")
            out.setdefault(str(experiment), {})[str(task)] = _options(path, f"per_task.{experiment}.{task}", values)
    return out


def _read_per_experiment(path: Path, raw: Any, experiments: list[Any]) -> dict[str, dict[str, Any]]:
    """Check ``per_experiment: {experiment: {option.key: value}}`` against the suite's experiments."""
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: `per_experiment` must map experiments to option overrides")
    out = {}
    for experiment, values in raw.items():
        if str(experiment) not in map(str, experiments) or not isinstance(values, dict):
            raise ValueError(f"{path}: per_experiment: {experiment!r} is not one of the suite's experiments")
        out[str(experiment)] = _options(path, f"per_experiment.{experiment}", values)
    return out


def _options(path: Path, where: str, values: dict) -> dict[str, Any]:
    for key in values:
        if "." not in str(key) or str(key).split(".")[0] not in SEARCH_ROOTS or key in SWEEP_OWNED:
            raise ValueError(f"{path}: {where}: {key!r} is not an option key like train.lr")
    return {str(k): v for k, v in values.items()}


def list_suites(configs: Path) -> list[str]:
    """Names of the suite files."""
    return preset_names(configs / "suites")
