"""Experiments and suites: small YAML files that hold only their differences from petl's defaults.

An experiment names a method and the options that make it that experiment (``lora.yaml`` is
``method: {name: lora, rank: 8}``), optionally with ``train:`` / ``model:`` overrides it needs.
A suite lists experiments, tasks and seeds, plus the ``train:`` / ``model:`` overrides of its protocol.
Both become Hydra override strings, the same language ``petl-run`` speaks, so a sweep run here and a
``petl-run --multirun`` sweep compose identical configs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# Config groups an experiment or suite may override; `data`, `seed` and `output_dir` belong to the sweep.
OVERRIDABLE_GROUPS = ("train", "model")

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
    """Flatten nested ``values`` under ``prefix`` into ``prefix.key=value`` override strings."""
    out = []
    for key, value in values.items():
        path = f"{prefix}.{key}"
        out += to_overrides(path, value) if isinstance(value, Mapping) else [f"{path}={format_value(value)}"]
    return out


def _read_yaml(path: Path, allowed: set[str]) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
    for group in OVERRIDABLE_GROUPS:
        if not isinstance(data.get(group, {}), dict):
            raise ValueError(f"{path}: `{group}` must be a mapping of overrides")
    return data


@dataclass(frozen=True)
class Experiment:
    """One method configuration, as differences from the defaults.

    Attributes:
        name: the file stem; also the results folder name.
        method: ``{"name": ..., <option>: value}``.
        groups: overrides of other config groups, e.g. ``{"train": {"lr": 1e-4}}``.
        description: one line for humans.
        published: the row name of this experiment in the published tables (``LoRA``), or ``""``.
        published_note: why petl's parameter count differs from the published one, or ``""``; either
            one text for every published table or a mapping from table key (``vtab1k``, ``fgvc``) to text.

    """

    name: str
    method: dict[str, Any]
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    description: str = ""
    published: str = ""
    published_note: str | dict[str, str] = ""

    def overrides(self) -> list[str]:
        """Hydra overrides selecting the method group, then its options and other groups' values."""
        options = {k: v for k, v in self.method.items() if k != "name"}
        out = [f"method={self.method['name']}"] + to_overrides("method", options)
        for group, values in self.groups.items():
            out += to_overrides(group, values)
        return out


@dataclass(frozen=True)
class Suite:
    """A benchmark protocol: experiments × tasks × seeds with shared overrides."""

    name: str
    experiments: list[str]
    tasks: list[str]
    seeds: list[int]
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    description: str = ""

    def overrides(self) -> list[str]:
        """Hydra overrides of the suite's protocol (epochs, model...)."""
        return [o for group, values in self.groups.items() for o in to_overrides(group, values)]


def _names(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


def load_experiment(name: str, benchmarks_dir: Path) -> Experiment:
    """Read ``experiments/<name>.yaml``.

    Raises:
        ValueError: an unknown experiment (listing the known ones) or a malformed file.

    """
    path = benchmarks_dir / "experiments" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(_names(benchmarks_dir / "experiments"))
        raise ValueError(f"unknown experiment {name!r}; known: {known}")
    data = _read_yaml(path, {"description", "method", "published", "published_note", *OVERRIDABLE_GROUPS})
    method = data.get("method")
    if not isinstance(method, dict) or "name" not in method:
        raise ValueError(f"{path}: `method` must be a mapping with a `name`")
    groups = {g: data[g] for g in OVERRIDABLE_GROUPS if data.get(g)}
    return Experiment(
        name,
        dict(method),
        groups,
        str(data.get("description", "")),
        str(data.get("published") or ""),
        _note(data.get("published_note"), path),
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
    data = _read_yaml(path, {"description", "experiments", "tasks", "seeds", *OVERRIDABLE_GROUPS})
    for key in ("experiments", "tasks", "seeds"):
        if not isinstance(data.get(key), list) or not data[key]:
            raise ValueError(f"{path}: `{key}` must be a non-empty list")
    groups = {g: data[g] for g in OVERRIDABLE_GROUPS if data.get(g)}
    return Suite(
        name,
        [str(e) for e in data["experiments"]],
        [str(t) for t in data["tasks"]],
        [int(s) for s in data["seeds"]],
        groups,
        str(data.get("description", "")),
    )


def list_experiments(benchmarks_dir: Path) -> list[str]:
    """Names of the experiment files."""
    return _names(benchmarks_dir / "experiments")


def list_suites(benchmarks_dir: Path) -> list[str]:
    """Names of the suite files."""
    return _names(benchmarks_dir / "suites")
