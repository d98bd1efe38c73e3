"""Experiments and suites: small YAML files that hold only their differences from petl's defaults.

An experiment names a method and the options that make it that experiment (``lora.yaml`` is
``method: {name: lora, rank: 8}``), optionally with ``train:`` / ``model:`` overrides it needs, method
options to search (``search:``) and the published row it stands for (``published:``).  A registered
method without an experiment file of its name is an experiment too, with its registry defaults: adding a
method to petl adds it to the benchmark.

A suite is a whole protocol: experiments, tasks, the final runs' seeds and split, the ``train:`` /
``model:`` / ``data:`` overrides (backbone, recipe, augmentation) and, optionally, the ``search:`` space
selected on val (see :mod:`petl.bench.protocol`).  Everything becomes Hydra override strings, the same
language ``petl-run`` speaks, so a sweep run here and a ``petl-run`` command compose identical configs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# Config groups an experiment may override; a suite may also set `data` options (augmentation...), but
# `data.name`, `data.split`, `seed` and `output_dir` belong to the sweep.
OVERRIDABLE_GROUPS = ("train", "model")
SUITE_GROUPS = ("train", "model", "data")
_SWEEP_OWNED = ("data.name", "data.split", "seed", "output_dir")
# The roots a search space may vary: any option of these groups.
SEARCH_ROOTS = ("train", "model", "method", "data")
# The split the final runs train on when a suite searches (model selection used train800 / val200).
FINAL_SPLIT = "train800val200"
# `experiments: all` in a suite: every experiment file plus every registered method no file covers.
ALL = "all"

# Config nodes that take any key (see petl.run.config.ModelConfig.kwargs).
_FREE_FORM_NODES = ("model.kwargs",)

_SAFE_BARE = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")
_NOT_BARE = {"true", "false", "null", "none", "nan", "inf"}


def find_benchmarks_dir(override: str | Path | None = None) -> Path:
    """Locate the folder holding ``experiments/`` and ``suites/`` (see :func:`petl.presets.configs_dir`).

    Args:
        override: an explicit folder (the CLI's ``configs_dir=`` or ``benchmarks_dir=``); otherwise the
            checkout's top-level ``configs/``, else the installed package ``petl.configs``.

    Raises:
        FileNotFoundError: naming the folder that was looked for.

    """
    from petl.presets import configs_dir

    return configs_dir(override)


def format_value(value: Any) -> str:
    """Write a Python value in Hydra's override grammar (strings quoted unless plainly safe)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        # A bare word such as `sequential` stays bare for readable logs; anything that Hydra could read
        # as another type (true, 1e-3) or that holds grammar characters gets quoted.
        if _SAFE_BARE.match(value) and value.lower() not in _NOT_BARE:
            return value
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Iterable):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as a Hydra override")


def to_overrides(prefix: str, values: Mapping[str, Any]) -> list[str]:
    """Flatten nested ``values`` under ``prefix`` into ``prefix.key=value`` override strings.

    Keys under a free-form node (``model.kwargs``, any ``timm.create_model`` keyword) are new keys to
    Hydra, so they are written ``++key=value`` (add or replace) as on petl-run's command line.
    """
    out = []
    for key, value in flatten(prefix, values).items():
        add = "++" if any(key.startswith(node + ".") for node in _FREE_FORM_NODES) else ""
        out.append(f"{add}{key}={format_value(value)}")
    return out


def _read_yaml(path: Path, allowed: set[str], groups: tuple[str, ...] = OVERRIDABLE_GROUPS) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    for group in groups:
        if not isinstance(data.get(group, {}), dict):
            raise ValueError(f"{path}: `{group}` must be a mapping of overrides")
    return data


def flatten(prefix: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """Nested ``values`` under ``prefix`` as ``{"prefix.key.sub": value}``."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{prefix}.{key}"
        out.update(flatten(path, value) if isinstance(value, Mapping) else {path: value})
    return out


def read_space(path: Path | str, space: Any) -> dict[str, list[Any]]:
    """Check a ``search:`` mapping: dotted option keys (``train.lr``) to non-empty lists of values.

    Raises:
        ValueError: naming the file and the bad key.

    """
    if space is None:
        return {}
    if not isinstance(space, dict):
        raise ValueError(f"{path}: `search` must map option keys (train.lr) to lists of values")
    out = {}
    for key, values in space.items():
        key = str(key)
        root = key.split(".")[0]
        if "." not in key or root not in SEARCH_ROOTS or key in _SWEEP_OWNED:
            raise ValueError(
                f"{path}: search key {key!r}: expected an option of {', '.join(SEARCH_ROOTS)} such as train.lr "
                f"(not {', '.join(_SWEEP_OWNED)}, which the sweep sets)"
            )
        if not isinstance(values, list) or not values:
            raise ValueError(f"{path}: search key {key!r} must list at least one value, e.g. [1.0e-3, 1.0e-2]")
        out[key] = list(values)
    return out


@dataclass(frozen=True)
class Experiment:
    """One method configuration, as differences from the defaults.

    Attributes:
        name: the file stem; also the results folder name.
        method: ``{"name": ..., <option>: value}``.
        groups: overrides of other config groups, e.g. ``{"train": {"lr": 1e-4}}``.
        description: one line for humans.
        search: method options (or other keys) this experiment adds to a searching suite's space,
            e.g. ``{"method.rank": [4, 8]}``; ignored by suites that do not search.
        published: the row name of this experiment in the published tables (``LoRA``), or ``""``.
        published_note: why petl's parameter count differs from the published one, or ``""``; either
            one text for every published table or a mapping from table key (``vtab1k``, ``fgvc``) to text.

    """

    name: str
    method: dict[str, Any]
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    description: str = ""
    search: dict[str, list[Any]] = field(default_factory=dict)
    published: str = ""
    published_note: str | dict[str, str] = ""

    def fixed_keys(self) -> set[str]:
        """Dotted keys this experiment pins (``method.rank``, ``train.lr``): a suite's search leaves them alone."""
        options = {k: v for k, v in self.method.items() if k != "name"}
        keys = set(flatten("method", options))
        for group, values in self.groups.items():
            keys |= set(flatten(group, values))
        return keys

    def overrides(self) -> list[str]:
        """Hydra overrides selecting the method group, then its options and other groups' values."""
        options = {k: v for k, v in self.method.items() if k != "name"}
        out = [f"method={self.method['name']}"] + to_overrides("method", options)
        for group, values in self.groups.items():
            out += to_overrides(group, values)
        return out


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

    def task_overrides(self, experiment: str, task: str) -> list[str]:
        """The per-task settings of one experiment on one task, as Hydra overrides."""
        return [f"{k}={format_value(v)}" for k, v in self.per_task.get(experiment, {}).get(task, {}).items()]

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
        pinned = experiment.fixed_keys() | set(self.per_task.get(experiment.name, {}).get(task, {}))
        space = {k: v for k, v in self.search.items() if k not in pinned}
        space.update(experiment.search)
        return space


def _names(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _registered_methods() -> list[str]:
    # Imported late: reading suites for a report must not need torch.
    import petl

    return petl.list_methods()


def default_experiment(method: str) -> Experiment:
    """The benchmark experiment of a registered method that has no experiment file: its config defaults."""
    return Experiment(method, {"name": method}, description=f"{method} with its registry defaults (no experiment file)")


def load_experiment(name: str, benchmarks_dir: Path) -> Experiment:
    """Read ``experiments/<name>.yaml``, or a registered method's :func:`default_experiment` if there is none.

    Raises:
        ValueError: an unknown experiment (listing the known ones) or a malformed file.

    """
    path = benchmarks_dir / "experiments" / f"{name}.yaml"
    if not path.is_file():
        if name in _registered_methods():
            return default_experiment(name)
        raise ValueError(f"unknown experiment {name!r}; known: {', '.join(list_experiments(benchmarks_dir))}")
    keys = {"description", "method", "search", "published", "published_note", *OVERRIDABLE_GROUPS}
    data = _read_yaml(path, keys)
    method = data.get("method")
    if not isinstance(method, dict) or "name" not in method:
        raise ValueError(f"{path}: `method` must be a mapping with a `name`")
    groups = {g: data[g] for g in OVERRIDABLE_GROUPS if data.get(g)}
    return Experiment(
        name,
        dict(method),
        groups,
        str(data.get("description", "")),
        search=read_space(path, data.get("search")),
        published=str(data.get("published") or ""),
        published_note=_note(data.get("published_note"), path),
    )


def _note(value: Any, path: Path) -> str | dict[str, str]:
    # `published_note:` is one text, or one text per published table (`{fgvc: ...}`).
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}: `published_note` must be a text or a mapping from table key to text")
    return value or ""


def load_suite(name: str, benchmarks_dir: Path) -> Suite:
    """Read ``suites/<name>.yaml``.

    Raises:
        ValueError: an unknown suite (listing the known ones) or a malformed file.

    """
    path = benchmarks_dir / "suites" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(_names(benchmarks_dir / 'suites'))}")
    keys = {"description", "experiments", "tasks", "seeds", "search", "search_seed", "final_split", "per_task"}
    keys |= set(SUITE_GROUPS)
    data = _read_yaml(path, keys, SUITE_GROUPS)
    if data.get("experiments") == ALL:
        data["experiments"] = list_experiments(benchmarks_dir)
    for key in ("experiments", "tasks", "seeds"):
        if not isinstance(data.get(key), list) or not data[key]:
            raise ValueError(f"{path}: `{key}` must be a non-empty list" + (" (or `all`)" * (key == "experiments")))
    groups = {g: data[g] for g in SUITE_GROUPS if data.get(g)}
    owned = sorted(set(_SWEEP_OWNED) & {k for g, v in groups.items() for k in flatten(g, v)})
    if owned:
        raise ValueError(f"{path}: {', '.join(owned)} are set per run by the sweep (final_split: sets the split)")
    search = read_space(path, data.get("search"))
    if "search_seed" in data and not search:
        # A value without effect is a bug: the trial seed only acts when the suite selects on val.
        raise ValueError(f"{path}: `search_seed` needs a `search:` space (without one, runs train once per seed)")
    per_task = _read_per_task(path, data.get("per_task") or {}, data["experiments"], data["tasks"])
    return Suite(
        name,
        [str(e) for e in data["experiments"]],
        [str(t) for t in data["tasks"]],
        [int(s) for s in data["seeds"]],
        groups,
        str(data.get("description", "")),
        search=search,
        search_seed=int(data.get("search_seed", 0)),
        final_split=str(data.get("final_split", FINAL_SPLIT if search else "")) or None,
        per_task=per_task,
    )


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
            for key in values:
                if "." not in str(key) or str(key).split(".")[0] not in SEARCH_ROOTS or key in _SWEEP_OWNED:
                    where = f"per_task.{experiment}.{task}"
                    raise ValueError(f"{path}: {where}: {key!r} is not an option key like train.lr")
            out.setdefault(str(experiment), {})[str(task)] = {str(k): v for k, v in values.items()}
    return out


def list_experiments(benchmarks_dir: Path) -> list[str]:
    """Experiment files, plus every registered method that no experiment file runs (its registry defaults)."""
    files = _names(benchmarks_dir / "experiments")
    covered = set(files)
    for name in files:
        method = (yaml.safe_load((benchmarks_dir / "experiments" / f"{name}.yaml").read_text()) or {}).get("method")
        if isinstance(method, dict):
            covered.add(str(method.get("name")))
    return files + [m for m in _registered_methods() if m not in covered]


def list_suites(benchmarks_dir: Path) -> list[str]:
    """Names of the suite files."""
    return _names(benchmarks_dir / "suites")
