"""petl's user-facing presets: where the top-level ``configs/`` folder is, and its experiments.

In a source checkout (or an editable install) the folder sits beside the ``petl`` package; an
installed wheel carries it as the package ``petl.configs`` (``pyproject.toml`` maps that package onto
the same folder), found through :mod:`importlib.resources`.  Both ``petl-run`` and ``petl-bench`` ask
:func:`configs_dir`.

An experiment (``configs/experiments/<name>.yaml``) names a method and the options that make it that
experiment (``lora.yaml`` is ``method: {name: lora, rank: 8}``), optionally with ``train:`` / ``model:``
overrides it needs, method options to search (``search:``), the published row it stands for
(``published:``) and its method family (``family:``, one of :data:`FAMILIES`: how leaderboards group it).
A registered method without an experiment file of its name is an experiment too, with its registry defaults.
:meth:`Experiment.overrides` turns one into Hydra override strings, the language ``petl-run`` speaks:
``petl-run experiment=NAME`` and a ``petl-bench`` sweep compose the same config from it.  Suites
(:mod:`petl.bench.suite`) build on these.  Reading presets needs no torch.
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PRESET_FOLDERS = ("experiments", "suites")

# Method families an experiment file names (`family:`), in the order leaderboards list them, each with what
# its methods train.  Another name is accepted too (a plugin's own kind of method); it is listed after these.
FAMILIES = {
    "head": "a new head on the frozen backbone",
    "layers": "whole pretrained layers (all, or the last blocks)",
    "prompt": "learned tokens fed to the blocks",
    "adapter": "small modules added to the blocks",
    "low-rank": "low-rank or factorised weight updates",
    "scale-shift": "per-channel scales, shifts or biases",
    "sparse": "a selected subset of the pretrained weights",
    "side": "a side network beside the frozen backbone",
    "search": "a per-task searched mix of modules",
}

# Config groups an experiment may override.
OVERRIDABLE_GROUPS = ("train", "model")
# Keys a sweep sets per run: no experiment, suite or search may.
SWEEP_OWNED = ("data.name", "data.split", "seed", "output_dir")
# The roots a search space may vary: any option of these groups.
SEARCH_ROOTS = ("train", "model", "method", "data")

# Config nodes that take any key (see petl.train.config.ModelConfig.kwargs).
_FREE_FORM_NODES = ("model.kwargs",)

_SAFE_BARE = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")
_NOT_BARE = {"true", "false", "null", "none", "nan", "inf"}


def _has_presets(folder: Path) -> bool:
    return all((folder / name).is_dir() for name in PRESET_FOLDERS)


def configs_dir(override: str | Path | None = None) -> Path:
    """The folder holding ``experiments/`` and ``suites/``.

    Args:
        override: an explicit folder (``configs_dir=`` / ``benchmarks_dir=`` on the command line).

    Returns:
        The override; else the checkout's top-level ``configs/``; else the installed ``petl.configs``.

    Raises:
        FileNotFoundError: naming the folders that were looked at.

    """
    if override is not None:
        candidates = [Path(override)]
    else:
        # The checkout first: an editable install of an older tree may still map petl.configs elsewhere.
        candidates = [Path(__file__).resolve().parent.parent / "configs"]
        try:
            candidates.append(Path(str(importlib.resources.files("petl.configs"))))
        except ModuleNotFoundError:
            pass
    for folder in candidates:
        if _has_presets(folder):
            return folder
    looked = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"no configs folder with experiments/ and suites/ at {looked}; pass configs_dir=PATH "
        "(a checkout of the petl repository has one at its root)"
    )


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


def override(key: str, value: Any) -> str:
    """One Hydra override ``key=value``.

    Keys under a free-form node (``model.kwargs``, any ``timm.create_model`` keyword) are new keys to
    Hydra, so they are written ``++key=value`` (add or replace) as on petl-run's command line.
    """
    add = "++" if any(key.startswith(node + ".") for node in _FREE_FORM_NODES) else ""
    return f"{add}{key}={format_value(value)}"


def to_overrides(prefix: str, values: Mapping[str, Any]) -> list[str]:
    """Flatten nested ``values`` under ``prefix`` into override strings (:func:`override`)."""
    return [override(key, value) for key, value in flatten(prefix, values).items()]


class _Loader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where ``1e-3`` (no dot) is a string; YAML 1.2, OmegaConf and Hydra read a float.

    A string lr in a ``search:`` list would reach the run as 0.001 but be recorded as ``'1e-3'``, and the
    selection stamp would then refuse every final run; reading it as a float from the start avoids that.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"), list("-+0123456789.")
)


def read_yaml(path: Path) -> Any:
    """A preset file's contents (YAML 1.2 floats, see :class:`_Loader`).

    Raises:
        ValueError: one line naming the file, and the line and column of a syntax error.

    """
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}): save it as UTF-8") from None
    except OSError as error:  # a folder at the file's name, a file it may not read
        raise ValueError(f"{path}: cannot be read ({error.strerror}): give a YAML file there") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{path}{where}: malformed YAML ({problem}): fix the file") from None


def read_yaml_mapping(path: Path, allowed: set[str], groups: tuple[str, ...] = OVERRIDABLE_GROUPS) -> dict[str, Any]:
    """A preset file's top-level mapping, its keys checked against ``allowed`` and ``groups`` mappings."""
    data = read_yaml(path) or {}
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
        if "." not in key or root not in SEARCH_ROOTS or key in SWEEP_OWNED:
            raise ValueError(
                f"{path}: search key {key!r}: expected an option of {', '.join(SEARCH_ROOTS)} such as train.lr "
                f"(not {', '.join(SWEEP_OWNED)}, which the sweep sets)"
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
        family: what kind of method it is (a key of :data:`FAMILIES`, or any other name), or ``""``:
            leaderboard plots give each family one marker and colour and one learning-curve panel.
        calibrate_once: under ``petl-bench``, the method's ``calibrate`` hook runs in the task's first run
            only and the task's other runs reuse its choice (:mod:`petl.bench.calibration`); only for a
            method that has the hook.

    """

    name: str
    method: dict[str, Any]
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    description: str = ""
    search: dict[str, list[Any]] = field(default_factory=dict)
    published: str = ""
    published_note: str | dict[str, str] = ""
    family: str = ""
    calibrate_once: bool = False

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


def preset_names(folder: Path) -> list[str]:
    """Stems of the YAML files in ``folder``, sorted."""
    return sorted(p.stem for p in folder.glob("*.yaml") if p.is_file())  # a folder so named is no preset


def _registered_methods() -> list[str]:
    # Imported late: reading suites for a report must not need torch.  Importing the methods registers them.
    import petl.methods  # noqa: F401
    from petl.model.registry import list_methods

    return list_methods()


def _has_calibrate_hook(method: str) -> bool | None:
    # None for an unknown method: the run names it, with the known ones.
    import petl.methods  # noqa: F401
    from petl.model.registry import get_method, list_methods

    return get_method(method).calibrate is not None if method in list_methods() else None


def default_experiment(method: str) -> Experiment:
    """The benchmark experiment of a registered method that has no experiment file: its config defaults."""
    return Experiment(method, {"name": method}, description=f"{method} with its registry defaults (no experiment file)")


def load_experiment(name: str, configs: Path) -> Experiment:
    """Read ``experiments/<name>.yaml``, or a registered method's :func:`default_experiment` if there is none.

    Raises:
        ValueError: an unknown experiment (listing the known ones) or a malformed file.

    """
    path = configs / "experiments" / f"{name}.yaml"
    if not path.is_file():
        if name in _registered_methods():
            return default_experiment(name)
        raise ValueError(f"unknown experiment {name!r}; known: {', '.join(list_experiments(configs))}")
    keys = {"description", "method", "search", "published", "published_note", "family", "calibrate_once"}
    data = read_yaml_mapping(path, {*keys, *OVERRIDABLE_GROUPS})
    method = data.get("method")
    if not isinstance(method, dict) or "name" not in method:
        raise ValueError(f"{path}: `method` must be a mapping with a `name`")
    calibrate_once = data.get("calibrate_once", False)
    if not isinstance(calibrate_once, bool):
        raise ValueError(f"{path}: `calibrate_once` must be true or false, got {calibrate_once!r}")
    if calibrate_once and _has_calibrate_hook(str(method["name"])) is False:
        # A value without effect is a bug: only a method with a calibrate hook has something to reuse.
        raise ValueError(f"{path}: `calibrate_once`: method {method['name']} has no calibrate hook; remove the key")
    groups = {g: data[g] for g in OVERRIDABLE_GROUPS if data.get(g)}
    return Experiment(
        name,
        dict(method),
        groups,
        str(data.get("description", "")),
        search=read_space(path, data.get("search")),
        published=str(data.get("published") or ""),
        published_note=_note(data.get("published_note"), path),
        family=str(data.get("family") or ""),
        calibrate_once=calibrate_once,
    )


def _note(value: Any, path: Path) -> str | dict[str, str]:
    # `published_note:` is one text, or one text per published table (`{fgvc: ...}`).
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}: `published_note` must be a text or a mapping from table key to text")
    return value or ""


def list_experiments(configs: Path) -> list[str]:
    """Experiment files, plus every registered method that no experiment file runs (its registry defaults)."""
    files = preset_names(configs / "experiments")
    covered = set(files)
    for name in files:
        try:
            method = (read_yaml(configs / "experiments" / f"{name}.yaml") or {}).get("method")
        except (ValueError, AttributeError):
            continue  # a malformed file is named when it is loaded; listing the others must not fail on it
        if isinstance(method, dict):
            covered.add(str(method.get("name")))
    return files + [m for m in _registered_methods() if m not in covered]


def experiment_overrides(name: str, folder: str | Path | None = None) -> list[str]:
    """The Hydra overrides of experiment ``name`` (``petl-run experiment=NAME``), read from :func:`configs_dir`.

    Raises:
        ValueError: an unknown experiment (listing the known ones) or a malformed file.
        FileNotFoundError: no presets folder (see :func:`configs_dir`).

    """
    return load_experiment(name, configs_dir(folder)).overrides()
