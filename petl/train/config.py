"""The configuration of a run: typed schema, Hydra config groups, composition and validation.

The ``method`` group is generated from the method registry: every registered method gets one
structured node whose fields are its config dataclass's fields (plus ``name``), so the dataclasses
stay the only schema of method options and Hydra type-checks ``method.rank=abc`` by itself.  The
``data`` and ``model`` groups are generated the same way from petl's dataset registry and from
timm's ViT registry; ``train`` options are YAML files in ``petl/conf/train``.

Everything here that rejects user input raises :class:`ConfigError` with a one-line message that
names the key and the valid choices or range; the CLI prints it without a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import accelerate.utils
import timm
from accelerate.tracking import LOGGER_TYPE_TO_CLASS
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import II, MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

import petl.methods  # noqa: F401  (importing the methods registers them)
from petl import data as petl_data
from petl.backbones import models as petl_models
from petl.model.backbone import list_backbones, timm_modules
from petl.model.registry import get_method, list_methods, make_config
from petl.model.surgery import check_supported
from petl.store.result import not_utf8
from petl.train.engine import TrainSettings
from petl.train.options import check_options, neutral_keys, option
from petl.train.readers import (  # noqa: F401 (re-exported)
    RUNNER_FIELDS,
    check_built_size,
    check_overlay_size,
    data_info,
    data_options,
    image_size,
    method_options,
    model_kwargs,
)
from petl.utils.errors import ConfigError
from petl.utils.random import MAX_SEED
from petl.utils.text import first_line

CONFIG_GROUPS = ("method", "data", "model", "train")
# "auto" is resolved per machine before a run is fingerprinted (petl.train.build.resolve_precision); the others
# are what runs, save for the fallback make_accelerator logs (bf16 without support; fp16 or tf32 without a GPU are
# refused: petl.train.build.run_precision).
PRECISIONS = ("auto", "no", "tf32", "bf16", "fp16")
TRACKERS = tuple(LOGGER_TYPE_TO_CLASS)


def _check_trackers(key: str, trackers: Sequence[str]) -> None:
    for tracker in trackers:
        if tracker not in TRACKERS:
            raise ValueError(f"{key}: {tracker!r} is not valid: choose from {', '.join(TRACKERS)}")
        # accelerate would only warn and log nowhere; a tracker asked for and missing is an error.
        if not getattr(accelerate.utils, f"is_{tracker}_available", lambda: True)():
            raise ValueError(f"{key}: {tracker} is not installed (pip install {tracker})")


def _check_output_dir(key: str, value: str) -> None:
    if not str(value).strip():
        raise ValueError(f"{key} is empty: give the folder the run writes to")


@dataclass
class DataConfig:
    """Which dataset to train on, and how to load it.

    Attributes:
        name: a name from :func:`petl.data.list_datasets`; ``folder`` and ``hf`` are your own images.
        split: ``train800`` (train on 800, select on val200) or ``train800val200`` (final run on all 1000).
        root: folder holding the dataset in the field's layout; ``None`` uses the dataset's default source.
            Refused by datasets that read none (mini), required by ``folder`` and ``hf``.
        image_column: ``hf`` only: the column holding the images (default: the first Image feature).
        label_column: ``hf`` only: the column holding the labels (default: the first ClassLabel feature).
        subset: keep this many examples of every split (a fixed random choice, for quick checks); ``None`` keeps all.
        augment: VPT's FGVC protocol (resize to 256/224 of the input size, random crop and flip for
            training, centre crop for evaluation); ``None`` = on for fgvc/* tasks, off otherwise.
        num_workers: DataLoader worker processes; 0 loads in the main process.  No result depends on it: augmented
            crops and flips are drawn from (seed, epoch, index) (:class:`petl.train.build.SeededAugmentation`).
        epochs: the dataset's default number of epochs (its ``DatasetInfo.epochs``), which
            ``train.epochs`` follows unless overridden; another value given beside another ``train.epochs`` is
            refused (it would do nothing).

    """

    name: str = MISSING
    split: str = option(petl_data.TRAIN, choices=petl_data.TRAINING_SPLITS)
    root: str | None = option(None, neutral=True)
    subset: int | None = option(None, low=1)
    image_column: str | None = None
    label_column: str | None = None
    augment: bool | None = None
    # Neutral: the order, dropout and drop-path do not see the workers, and augmented crops and flips are drawn
    # per item from (seed, epoch, index) (build.SeededAugmentation), not from a worker's or the global stream.
    num_workers: int = option(0, low=0, neutral=True)
    epochs: int = option(petl_data.PROTOCOL_EPOCHS, low=1)


@dataclass
class ModelConfig:
    """The backbone.

    Attributes:
        name: a timm model of a family petl takes (docs/backbones.md), optionally with a pretrained tag
            (``vit_base_patch16_224.augreg2_in21k_ft_in1k``).
        pretrained: load the tag's pretrained weights (from the hub, or a file petl ships).
        checkpoint: a local weights file to load instead of the tag's source (offline clusters); refused beside
            ``model.pretrained=false``, which loads no weights.
        img_size: the side (px) of the square images the backbone is built for; ``None`` keeps its timm default.
            The data pipeline resizes to the built model's size whichever way it was set (this option or
            ``+model.kwargs.img_size``); a pretrained position grid is resampled by the model's own loader.
        drop_path: stochastic-depth rate; in frozen blocks it acts only when the backbone trains in
            train mode (``train.backbone_mode``, by default the method's reference choice); a rate other than 0
            and this default that no block in train mode holds is refused (so is a ``model.kwargs`` dropout rate).
        kwargs: extra keyword arguments for ``timm.create_model`` (e.g. ``+model.kwargs.depth=2``); ``num_classes``
            is refused (the data sets it), and one the pretrained weights do not fit is named with their keys.
            ``pretrained_cfg_overlay`` is taken only as ``{input_size: [3, N, N]}``: the size a NaFlexVit, which
            sizes its images by its pretrained config, trains at (``model.json`` carries it).

    """

    name: str = MISSING
    pretrained: bool = True
    checkpoint: str | None = None
    img_size: int | None = option(None, low=1)
    drop_path: float = option(0.1, low=0, high=1)
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig(TrainSettings):
    """Optimisation and engine settings: the engine's :class:`TrainSettings` plus run-level options.

    The inherited fields (lr, weight_decay, warmup_frac, label_smoothing, grad_clip, progress) keep
    the engine's defaults, the field's VTAB-1k recipe, so that the two never drift apart.

    Attributes:
        batch_size: training images per step and process (effective batch: x processes x grad_accum); also the
            batch of a method's calibrate hook (GPS's selection gradient, NOAH's supernet steps).  One above the
            training images takes them all a step (not refused: the default is above small folders); the first line
            and result.json's ``effective_batch_size`` give the batch that ran.
        eval_batch_size: images per step when evaluating.
        grad_accum: micro-batches accumulated per optimizer step; each step's gradient is the mean over its images,
            as one batch of them would give, also for an epoch's last step of fewer or shorter batches.  More than
            the batches an epoch holds (per process) is refused: a step never accumulates more.
        precision: ``auto`` (bf16 autocast on a CUDA GPU with native bf16, else ``no``; the run's config.yaml and
            result.json record what it became on the machine that ran), ``no`` (fp32, with TF32 matmuls off also on
            a GPU: strict fp32, as every petl run before ``auto``), ``tf32`` (fp32 tensors, CUDA matmuls and
            convolutions on TF32 tensor cores), or accelerate's mixed precision ``bf16`` / ``fp16`` (TF32 on for the
            fp32 matmuls autocast leaves, as in timm's train.py).  ``tf32`` and ``fp16`` act on a CUDA GPU only, and
            are refused by a run on another device.
        cache_features: train on cached activations of the frozen part of the backbone, when there is one;
            ``false`` where nothing would be cached (a method that trains from the first block on, a backbone in train
            mode, augmented training images) is refused.
        grad_checkpointing: recompute each block's activations during the backward instead of keeping them
            (timm's ``set_grad_checkpointing``, applied by the runner): less memory, one more forward per block.
            Refused where it cannot act: a side network, and a method that trains only the head (linear, Mlp-k).
        compile: compile the model with ``torch.compile`` (accelerate's dynamo backend, set up by the runner);
            on CPU it needs a C++ compiler and is skipped with a warning without one.
        deterministic: use deterministic algorithms where torch has them (CPU runs repeat exactly; on CUDA also
            a fixed cuBLAS workspace and no cuDNN autotuning); false turns them off for the run, and on CUDA turns
            cuDNN's autotuner (``cudnn.benchmark``) on, as timm's train.py does.
        trackers: experiment trackers through accelerate (``tensorboard``, ``wandb``...); none by default.
        keep_checkpoint: keep the last per-epoch checkpoint after the run has finished (the same command run again
            without it returns the finished run and leaves the checkpoint kept).
        eval_test: evaluate the test split once after the last epoch; ``false`` for the selection trials of
            ``petl-bench`` (their result then has ``test_top1: null``, so no choice can see a test number).

    """

    epochs: int = option(II("data.epochs"), low=1)
    batch_size: int = option(64, low=1)
    eval_batch_size: int = option(256, low=1, neutral=True)
    grad_accum: int = option(1, low=1)
    precision: str = option("auto", choices=PRECISIONS)
    cache_features: bool = True
    grad_checkpointing: bool = False
    compile: bool = False
    deterministic: bool = True
    trackers: list[str] = option(default_factory=list, check=_check_trackers, neutral=True)
    keep_checkpoint: bool = option(False, neutral=True)
    eval_test: bool = True


@dataclass
class RunConfig:
    """A whole run: one node per config group plus the seed and where the results go.

    Attributes:
        method: the method's options (one structured node per registered method, with ``name``).
        data: see :class:`DataConfig`.
        model: see :class:`ModelConfig`.
        train: see :class:`TrainConfig`.
        seed: seeds the model init, the new modules and the data order; 0 to 2**32 - 1 (numpy's seeds).
        output_dir: where the run writes its config, metrics, weights and result.
        resume: continue an unfinished run found in ``output_dir`` (or return its result if it finished);
            ``false`` starts over, moving what an earlier run left there aside to
            ``<output_dir>.replaced-<time>/`` once the new run has built its model and data (nothing is deleted).

    """

    method: Any = MISSING
    data: DataConfig = MISSING
    model: ModelConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    # numpy seeds its global stream (accelerate's set_seed) up to MAX_SEED only, failing the run past it.
    seed: int = option(0, low=0, high=MAX_SEED)
    output_dir: str = option(
        "runs/${petl.slug:${data.name}}/${petl.slug:${model.name}}/${method.name}/seed${seed}",
        check=_check_output_dir,
        neutral=True,
    )
    resume: bool = option(True, neutral=True)


def _slug(value: str) -> str:
    # Dataset names contain "/" (``vtab/cifar100``); one directory level per run part reads better.
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", str(value)).strip("-")


def list_models() -> list[str]:
    """The timm model names the ``model`` group accepts: architectures and architecture.tag names.

    Those of the timm modules whose models a registered backbone family takes (``timm_modules``).
    """
    modules = timm_modules()
    return sorted(set(timm.list_models(module=modules, pretrained=True)) | set(timm.list_models(module=modules)))


def _cli_type(hint: Any) -> Any:
    """The OmegaConf annotation for a method field's type hint.

    ``tuple[str, ...]`` becomes ``list[str]`` because the command line (and YAML) hand over lists;
    :func:`method_options` turns them back into tuples.  Types OmegaConf cannot check (general unions,
    literals) fall back to ``Any`` and are left to the method's own ``validate``.
    """
    origin = typing.get_origin(hint)
    if origin is tuple:
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return list[args[0]] if len(set(args)) == 1 else list[Any]
    try:
        OmegaConf.structured(dataclasses.make_dataclass("_Probe", [("x", hint, field(default=MISSING))]))
    except (OmegaConfBaseException, ValueError, TypeError):
        return Any
    return hint


def method_node(name: str) -> type:
    """A dataclass with method ``name``'s options plus a ``name`` field: its node in the ``method`` group."""
    spec = get_method(name)
    hints = typing.get_type_hints(spec.config_cls)
    node_fields: list[tuple[str, Any, Any]] = [("name", str, field(default=name))]
    for f in dataclasses.fields(spec.config_cls):
        if f.name in RUNNER_FIELDS or not f.init:
            continue
        default = (
            field(default_factory=f.default_factory)
            if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING
            else field(default=f.default)
        )
        node_fields.append((f.name, _cli_type(hints[f.name]), default))
    return dataclasses.make_dataclass(f"{spec.config_cls.__name__}Options", node_fields)


_registered = False
_registered_models: set[str] = set()
_registered_methods: set[str] = set()
_registered_datasets: set[str] = set()


def register_configs() -> None:
    """Register the schema and the generated ``method`` and ``data`` groups (once per process).

    The ConfigStore is a process-wide singleton that Hydra launchers ship to their jobs, so jobs
    of a sweep (local or on a cluster) see the same groups.  Methods are looked up on every call:
    one registered after the first composition (a plugin, a test) still joins the ``method`` group.
    """
    global _registered
    store = ConfigStore.instance()
    for name in list_methods():
        if name not in _registered_methods:
            store.store(group="method", name=name, node=method_node(name))
            _registered_methods.add(name)
    # Datasets too: a user's register_dataset after the first composition still joins the ``data`` group.
    for name in petl_data.list_datasets():
        if name not in _registered_datasets:
            # Hydra reads "data=mini/digits" as option "digits" of the nested group "data/mini".
            folder, _, leaf = name.rpartition("/")
            node = DataConfig(name=name, epochs=petl_data.get_info(name).epochs)
            store.store(group=f"data/{folder}" if folder else "data", name=leaf, node=node)
            _registered_datasets.add(name)
    if _registered:
        return
    if not OmegaConf.has_resolver("petl.slug"):
        OmegaConf.register_new_resolver("petl.slug", _slug)
    store.store(name="petl_schema", node=RunConfig)
    register_model(petl_models.DEFAULT_MODEL)
    _registered = True


def register_model(name: str) -> None:
    """Add ``name`` to the ``model`` group if it is a timm ViT (unknown names are left to the checks).

    Models are registered on demand, not all ~500 up front: Hydra deep-copies the whole
    ConfigStore on every composition, which would cost seconds per run.
    """
    store = ConfigStore.instance()
    if name in _registered_models or name not in list_models():
        return
    store.store(group="model", name=name, node=ModelConfig(name=name))
    _registered_models.add(name)


def register_models_in(overrides: Iterable[str]) -> None:
    """Register every model an override list names, including each value of a sweep (``model=a,b``)."""
    for override in overrides:
        key, eq, value = override.partition("=")
        if eq and key.lstrip("+~") == "model":
            for name in re.split(r"[,()\[\]\s]+", value):
                if name:
                    register_model(name)


def group_choices(group: str) -> list[str]:
    """Valid options of a config group."""
    if group == "method":
        return list_methods()
    if group == "data":
        return petl_data.list_datasets()
    if group == "model":
        return list_models()
    if group == "train":
        files = resources.files("petl.conf").joinpath("train").iterdir()
        return sorted(f.name[: -len(".yaml")] for f in files if f.name.endswith(".yaml"))
    raise KeyError(group)


def unknown_choice_message(group: str, value: str) -> str:
    """One line naming the bad choice and the valid ones (the closest ones, for the long model list)."""
    choices = group_choices(group)
    noun = {"data": "dataset", "train": "train recipe"}.get(group, group)
    if group == "model":
        close = difflib.get_close_matches(value, choices, n=5, cutoff=0.5)
        hint = f"did you mean: {', '.join(close)}? " if close else ""
        return (
            f"unknown model {value!r}; {hint}choose a timm model of a family petl takes "
            f"({', '.join(list_backbones())}: timm's {', '.join(timm_modules())} modules), "
            f"e.g. {petl_models.DEFAULT_MODEL}, "
            'vit_base_patch16_224.augreg2_in21k_ft_in1k (all: python -c "import petl.train.config as c; '
            'print(*c.list_models(), sep=chr(10))" | grep NAME)'
        )
    return f"unknown {noun} {value!r}; choose one of: {', '.join(choices)}"


def check_group_choice(group: str, value: str) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an option of ``group``."""
    if value not in group_choices(group):
        raise ConfigError(unknown_choice_message(group, value))


def explain(error: Exception, overrides: Sequence[str] = ()) -> str:
    """Turn a Hydra/OmegaConf composition error into one line that names the key and what is valid.

    Reads the exceptions' public attributes (``missing_cfg_file``, ``full_key``, ``msg``) rather
    than their text, so a rewording in Hydra or OmegaConf cannot change what users see.
    """
    if isinstance(error, OverrideParseException):
        quoted = shell_quoted(error.override)
        # Hydra reads an unquoted value of ASCII letters, digits and a few signs only: a folder named 'Fotos ü',
        # 'photos (2)' or "it's" must be quoted, and in a shell the quotes must survive the shell's own.
        hint = f"quote the value, in a shell: {quoted}" if quoted else "quote values holding special characters"
        return f"cannot parse override {error.override!r}: {first_line(error.message)} ({hint})"
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        group, _, value = error.missing_cfg_file.partition("/")
        if group in CONFIG_GROUPS:
            return unknown_choice_message(group, value)
        # e.g. hydra/launcher=submitit_slurm without its plugin installed
        return f"{first_line(str(error))} (is the Hydra plugin that provides it installed?)"
    cause = error.__cause__ if error.__cause__ is not None else error
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return unknown_key_message(cause.full_key or cause.key or "?", overrides)
    if not isinstance(cause, OmegaConfBaseException):
        sweep = _sweep_override(overrides)
        if sweep is not None:  # Hydra composes one config; a,b is a sweep only under --multirun
            return (
                f"Ambiguous value for argument {sweep!r}: to sweep over the values add --multirun, "
                f"to pass a list write key=[a,b], to pass one value holding commas (a folder's name) quote it, in a "
                f"shell: {shell_quoted(sweep) or sweep}"
            )
    full_key = getattr(cause, "full_key", None)
    line = first_line(getattr(cause, "msg", None) or str(cause))
    return f"{full_key}: {line}" if full_key and full_key not in line else line


def shell_quoted(override: str) -> str | None:
    r"""``key=value`` as a shell argument that gives Hydra ``value`` as one quoted string; None for a list or dict.

    ``data.root=photos (2)`` becomes ``"data.root='photos (2)'"``: the shell drops the double quotes, Hydra the
    single ones (a ``'`` in the value escaped as ``\'``).  A value the shell would expand inside double quotes
    (``$``, a backquote, ``"``, ``!``) is quoted by :func:`shlex.quote` instead; one holding a ``\`` gets no hint.
    """
    key, equals, value = override.partition("=")
    if not equals or value[:1] in ("[", "{", "'", '"') or "\\" in value:  # a backslash: Hydra's escapes, too rare
        return None
    inner = f"{key}='{value.replace(chr(39), chr(92) + chr(39))}'"
    return shlex.quote(inner) if any(sign in value for sign in '$`"!') else f'"{inner}"'


def _sweep_override(overrides: Sequence[str]) -> str | None:
    """The first override that is a sweep (``seed=1,2``), as typed; ``None`` when there is none."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return None
    return next((o.input_line for o in parsed if o.is_sweep_override()), None)


def unknown_key_message(key: str, overrides: Sequence[str] = ()) -> str:
    """One line naming an unknown config key and the valid keys beside it."""
    parent = key.rpartition(".")[0]
    # Compose again with only the group choices so the listing shows the nodes actually selected.
    chosen = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in CONFIG_GROUPS]
    try:
        base = compose_config(chosen)
        node = OmegaConf.select(base, parent) if parent else base
    except (ConfigError, HydraException, OmegaConfBaseException):
        node = None
    valid = ", ".join(node.keys()) if isinstance(node, DictConfig) else "?"
    where = f"under '{parent}'" if parent else "at the top level"
    if parent == "method" and isinstance(node, DictConfig):
        where += f" (method {node.name})"
    return f"unknown config key {key!r}; valid keys {where}: {valid}"


def compose_config(overrides: Iterable[str] = ()) -> DictConfig:
    """Compose ``petl/conf/config.yaml`` with Hydra overrides (no validation of values)."""
    register_configs()
    overrides = list(overrides)
    register_models_in(overrides)
    hydra = GlobalHydra.instance()
    # Inside a running Hydra app (a sweep job, a notebook using Hydra) Global Hydra is taken;
    # compose in a fresh one and put the caller's back afterwards.
    saved = hydra.hydra if hydra.is_initialized() else None
    hydra.clear()
    try:
        with initialize_config_module("petl.conf", version_base="1.3"):
            return compose("config", overrides=overrides)
    finally:
        if saved is not None:
            hydra.clear()
            hydra.initialize(saved)


def method_error(name: str, error: Exception, sources: Mapping[str, str] | None = None) -> ConfigError:
    """A method's refusal as a config error, prefixed with the method unless its message already names it.

    A refusal that starts with the option it names (``reduction=8: ...``) says where a file set it
    (``reduction=8 (set by experiment=lst): ...``): the user never typed it.
    """
    text = str(error)
    named = re.match(r"(\w+)=", text)
    if named and set_by(f"method.{named[1]}", sources):
        end = _value_end(text, named.end())
        text = text[:end] + set_by(f"method.{named[1]}", sources) + text[end:]
    return ConfigError(text if text.startswith(f"method {name!r}") else f"method {name}: {text}")


def _value_end(text: str, start: int) -> int:
    """Where the value written from ``start`` ends: at a space or colon outside its brackets and quotes.

    A list (``dims=[8, 16]``) or a quoted string (``options='{"a": 1}'``) holds spaces and colons of its own.
    """
    depth, quote = 0, ""
    for i in range(start, len(text)):
        char = text[i]
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth <= 0 and (char.isspace() or char == ":"):
            return i
    return len(text)


def default_config(overrides: Iterable[str] = (), sources: Mapping[str, str] | None = None) -> DictConfig:
    """The default run configuration with Hydra command-line style overrides applied and checked.

    Args:
        overrides: e.g. ``["method=lora", "method.rank=4", "data=mini/digits", "train.epochs=2"]``.
        sources: the keys of ``overrides`` that a file set, not the user (``{"method.reduction": "experiment=lst"}``:
            petl-run's ``experiment=``, petl-bench's suite and experiment files), so that a refusal names where such a
            value came from; the keys a train recipe chosen in ``overrides`` sets (``train=smoke``) are found here
            (:func:`recipe_sources`).

    Returns:
        The composed config (interpolations such as ``output_dir`` left unresolved).

    Raises:
        ConfigError: an unknown choice or key, a wrong type or a value out of range, or one string given where a
            list is taken (one-line message).

    """
    if isinstance(overrides, str):  # a string is iterable too: its letters would be read as overrides
        raise ConfigError(f"default_config takes a list of overrides, got one string: write [{overrides!r}]")
    overrides = list(overrides)
    cfg = _compose_checked(overrides)
    sources = {**recipe_sources(overrides), **(sources or {})}
    check_values(cfg, sources)
    check_method(cfg, sources)
    return cfg


def recipe_sources(overrides: Iterable[str]) -> dict[str, str]:
    """The keys the train recipe chosen in ``overrides`` (``train=smoke``) sets, each with ``train=NAME``.

    A key ``overrides`` give themselves is left out: Hydra applies it after the recipe's file, so it wins.
    """
    overrides = list(overrides)
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    recipe = next((o.split("=", 1)[1] for o in reversed(overrides) if o.split("=", 1)[0] == "train"), None)
    if recipe is None or "," in recipe or recipe not in group_choices("train"):
        return {}
    text = resources.files("petl.conf").joinpath(f"train/{recipe}.yaml").read_text(encoding="utf-8")
    sets = OmegaConf.create(text or "{}")  # the recipes are ``# @package _global_``: their keys are full
    keys = [key for key in _leaf_keys(OmegaConf.to_container(sets)) if key not in given]
    return {key: f"train={recipe}" for key in keys}


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return [prefix.rstrip(".")]
    return [key for name, value in node.items() for key in _leaf_keys(value, f"{prefix}{name}.")]


def set_by(key: str, sources: Mapping[str, str] | None) -> str:
    """`` (set by experiment=lst)`` after a value a file set rather than the command line; ``""`` for one typed."""
    return f" (set by {sources[key]})" if sources and key in sources else ""


def _compose_checked(overrides: Iterable[str]) -> DictConfig:
    """:func:`compose_config`, with unknown group choices and composition errors as ConfigError."""
    overrides = list(overrides)
    for override in overrides:
        key, eq, value = override.partition("=")
        if eq and key in CONFIG_GROUPS and "," not in value and "(" not in value:
            check_group_choice(key, value.strip())
    try:
        return compose_config(overrides)
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(explain(error, overrides)) from None


def to_config(cfg: DictConfig | Mapping[str, Any]) -> DictConfig:
    """A complete, type-checked run config from a composed config or a (partial) nested dict.

    Group nodes may be given as a name (``{"method": "lora"}``) or as a mapping with ``name``;
    whatever the mapping sets is merged onto that group's defaults, which type-checks it.
    """
    if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is RunConfig:
        # Already composed (default_config, Hydra) and typed: edits since then were type-checked on
        # assignment, only the ranges need a look (method options are checked when applied).
        check_values(cfg)
        return cfg
    if not isinstance(cfg, DictConfig | Mapping):  # dict() of a list or string fails without saying what to pass
        raise ConfigError(
            f"a run config must be a mapping, got {type(cfg).__name__}: give overrides to default_config, "
            "e.g. train(default_config(['method=lora']))"
        )
    raw = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else dict(cfg)
    choices = []
    for group in ("method", "data", "model"):
        node = raw.get(group)
        if isinstance(node, str):
            choices.append(f"{group}={node}")
            raw.pop(group)
        elif isinstance(node, Mapping) and "name" in node:
            choices.append(f"{group}={node['name']}")
    base = _compose_checked(choices)
    try:
        # model.kwargs is free-form (any timm.create_model keyword), the one node that takes new keys.
        with open_dict(base.model.kwargs):
            merged = OmegaConf.merge(base, raw)
    except OmegaConfBaseException as error:
        raise ConfigError(explain(error, choices)) from None
    check_values(merged)
    check_method(merged)
    return merged


def check_values(cfg: DictConfig, sources: Mapping[str, str] | None = None) -> None:
    """Check a composed config: every node against its own declared options, and the group choices.

    Method options are checked on the model (:func:`check_method`).  ``sources``: the keys a file set, named so
    (:func:`default_config`).

    Raises:
        ConfigError: naming the field and its allowed range or choices.

    """
    try:
        schema = typing.get_type_hints(RunConfig)
        check_known_keys(cfg)
        # A path through a folder named in other bytes (lone surrogates in Python): result.json would record it, and
        # a record holding one is refused on read, so the run would refuse its own record on its next invocation.
        if unreadable := not_utf8(OmegaConf.to_container(cfg, resolve=False)):
            raise ValueError(
                f"config {unreadable}: result.json would record it, and no record holding it is read; rename that "
                "folder or give another"
            )
        check_options(RunConfig, cfg)
        for group in ("data", "model", "train"):
            check_options(schema[group], cfg[group], f"{group}.")
        check_group_choice("method", cfg.method.name)
        check_group_choice("data", cfg.data.name)
        check_group_choice("model", cfg.model.name)
        # data.epochs acts only through train.epochs, which follows it unless given: both given, it does nothing.
        if cfg.data.epochs != petl_data.get_info(cfg.data.name).epochs and cfg.train.epochs != cfg.data.epochs:
            # train.epochs from a recipe (train=smoke) was not given by the user, who cannot drop it.
            source = (sources or {}).get("train.epochs")
            todo = f"give train.epochs={cfg.data.epochs} in place of data.epochs" if source else "drop one of them"
            raise ValueError(
                f"data.epochs={cfg.data.epochs} cannot act: train.epochs={cfg.train.epochs} is "
                f"{f'set by {source}' if source else 'given'}, and the run trains that many; {todo}"
            )
        if cfg.train.weight_decay_all and cfg.train.weight_decay == 0:
            # Which tensors decay is moot where none does.
            raise ValueError(
                f"train.weight_decay_all=true{set_by('train.weight_decay_all', sources)} cannot act: "
                f"train.weight_decay=0{set_by('train.weight_decay', sources)} decays no tensor; give "
                "train.weight_decay_all=false, or a train.weight_decay above 0"
            )
        if cfg.model.checkpoint and not cfg.model.pretrained:
            # Refused here, not only when the backbone is built: a sweep's check before its first job names it.
            raise ValueError("model.checkpoint is set but model.pretrained=false: the file would be ignored")
    except OmegaConfBaseException as error:
        # An interpolation that does not resolve, or a missing mandatory value.
        raise ConfigError(explain(error)) from None
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse a key the schema does not declare, at the top level or in the ``data``, ``model`` and ``train`` nodes.

    Hydra's ``+key=value`` adds a key to any node, typed schema or not: ``+train.lrr=0.1`` (a typo of ``train.lr``)
    ran at the default lr, the typo recorded in config.yaml and read by nothing.  ``model.kwargs`` is free-form (timm
    checks its keys), and the method node's keys are checked by the method (:func:`method_options`).

    Raises:
        ConfigError: naming the key and the valid keys beside it.

    """
    schema = typing.get_type_hints(RunConfig)
    nodes = [("", RunConfig, cfg)] + [(f"{group}.", schema[group], cfg[group]) for group in ("data", "model", "train")]
    for prefix, node_type, node in nodes:
        valid = [f.name for f in dataclasses.fields(node_type)]
        unknown = [key for key in node if key not in valid]
        if unknown:
            where = f"under '{prefix[:-1]}'" if prefix else "at the top level"
            raise ConfigError(
                f"unknown config key '{prefix}{unknown[0]}' (a + before a key adds it, and nothing would read it); "
                f"valid keys {where}: {', '.join(valid)}"
            )


def option_default(key: str, method: str | None = None) -> Any:
    """The declared default of a dotted option (``train.lr``, ``method.rank`` of ``method``), or ``MISSING``.

    An option added to petl after a run was recorded takes this value for that run: the run-folder rules
    (:mod:`petl.train.output_dir`) compare a new option with it instead of with nothing.
    """
    group, _, name = key.partition(".")
    if group == "method":
        try:
            node: Any = get_method(method).config_cls if method else None
        except (KeyError, ValueError):
            node = None
    else:
        node = typing.get_type_hints(RunConfig).get(group) if name else RunConfig
        name = name or group
    if node is None or not dataclasses.is_dataclass(node):
        return MISSING
    found = next((f for f in dataclasses.fields(node) if f.name == name), None)
    if found is None:
        return MISSING
    if found.default_factory is not dataclasses.MISSING:
        return found.default_factory()
    return MISSING if found.default is dataclasses.MISSING else found.default


def run_neutral_keys() -> set[str]:
    """The options of a run that do not change what it computes (marked ``neutral`` on their fields)."""
    return neutral_keys(RunConfig)


def check_method(cfg: DictConfig, sources: Mapping[str, str] | None = None) -> None:
    """Check the image size and the method options against the chosen backbone (depth, width) without building it.

    The model is instantiated on PyTorch's ``meta`` device: it has shapes but no storage, so
    even a ViT-L costs a fraction of a second and no weights are loaded.  ``sources``: the keys a file set, named so
    (:func:`default_config`).

    Raises:
        ConfigError: naming the method field and its allowed range (``k`` larger than the depth...), the
            image size the data pipeline cannot feed, or a ``model.img_size`` the model is not built for.

    """
    import torch

    kwargs = model_kwargs(cfg)
    try:
        with torch.device("meta"):
            # With the run's drop-path rate: _check_applied looks for the DropPath modules it makes.
            model = timm.create_model(cfg.model.name, pretrained=False, drop_path_rate=cfg.model.drop_path, **kwargs)
    except TypeError as error:
        raise ConfigError(f"model.kwargs: {error}") from None
    # The refusal names the key the size was given as.
    key = "model.img_size" if cfg.model.img_size is not None else "model.kwargs.img_size"
    built = check_built_size(model, cfg.model.name, kwargs.get("img_size"), key=key)
    check_overlay_size(built, cfg.model.name, kwargs)
    num_classes = data_info(cfg).num_classes
    try:
        options = method_options(cfg)
    except ConfigError:
        raise  # a runner field given: the message names its key
    except ValueError as error:
        raise method_error(cfg.method.name, error, sources) from None
    try:
        # The backbone first: a method's options are read against a backbone it supports (SCT's default top_n
        # asks for a single width, which a Swin has not).
        check_supported(model, cfg.method.name)
        method_cfg = make_config(cfg.method.name, num_classes=num_classes, **options)
        method_cfg.validate(model)
    except ValueError as error:
        raise method_error(cfg.method.name, error, sources) from None
    _check_applied(cfg, model, method_cfg)


def _stochastic_options(cfg: DictConfig) -> dict[str, type]:
    """The dropout and drop-path rates the user chose (non-zero, not the default), each with its timm module."""
    from timm.layers import DropPath, PatchDropout
    from torch import nn

    chosen: dict[str, type] = {}
    # The default (0.1, the VTAB-1k recipe's) stays for every method: documented as acting in train mode only.
    if cfg.model.drop_path not in (0, option_default("model.drop_path")):
        chosen[f"model.drop_path={cfg.model.drop_path:g}"] = DropPath
    for key, value in cfg.model.kwargs.items():
        if "drop" in key and isinstance(value, int | float) and value:
            kind = DropPath if "drop_path" in key else PatchDropout if "patch_drop" in key else nn.Dropout
            chosen[f"model.kwargs.{key}={value:g}"] = kind
    return chosen


def check_cache_option_acts(cfg: DictConfig, model: Any | None) -> None:
    """Refuse ``train.cache_features=false`` where the run would cache nothing anyway (``cache.decide``'s reasons).

    A model, its method applied, that leaves nothing frozen in front of what trains (LoRA), a backbone that runs in
    train mode, augmented training images (``data.augment``, on by default for fgvc/* tasks).  Checked on the meta
    model when the config is composed, so that a sweep's check before it trains finds every run that refuses it
    (``model`` ``None`` where the meta model cannot tell: a method whose calibration chooses where it acts, as NOAH's
    search may leave the first block as it is, or one the meta device cannot apply; the settings are checked still),
    and again by the runner on the real model, which also refuses it where the cache would exceed its size limit.

    Raises:
        CacheOptionError: naming the option and why nothing is cached (its ``reason``).

    """
    from petl.train import cache

    if cfg.train.cache_features:
        return
    if model is not None and cache.plan(model) is None:
        raise cache.CacheOptionError(cache.NOTHING_FROZEN, cfg.method.name)
    mode = cfg.train.backbone_mode
    # The method's reference mode under auto, as engine.backbone_mode reads it off the applied model.
    trains = (get_method(cfg.method.name).config_cls.backbone_mode if mode == "auto" else mode) == "train"
    augmented = petl_data.get_info(cfg.data.name).crops(cfg.data.augment)
    reason = cache.uncached_by_settings(backbone_trains=trains, augmented=augmented)
    if reason is not None:
        raise cache.CacheOptionError(reason)


def check_grad_checkpointing_acts(cfg: DictConfig, model: Any) -> None:
    """Refuse ``train.grad_checkpointing=true`` on a model, its method applied, where only the classifier head trains.

    Checked on the meta model when the config is composed (so a sweep's check before it trains names it) and again
    by the runner on the real one.

    Raises:
        ConfigError: naming the option and the method.

    """
    from petl.model.params import count_params

    if cfg.train.grad_checkpointing and count_params(model).trainable_no_head == 0:
        # Nothing in the blocks takes a gradient: their backward, which checkpointing recomputes for, never runs.
        raise ConfigError(
            f"train.grad_checkpointing=true cannot act: method {cfg.method.name} trains only the classifier head, "
            "so no block's activations are kept for a backward; drop it"
        )


def _check_applied(cfg: DictConfig, model: Any, method_cfg: Any) -> None:
    """Check the options whose effect depends on the method's modules on the meta model, the method applied.

    ``train.grad_checkpointing`` (refused by the side networks, and where only the head trains),
    ``train.cache_features=false`` (refused where the run would cache nothing: :func:`check_cache_option_acts`) and a
    chosen dropout or drop-path rate (``model.drop_path``, ``model.kwargs.drop_rate``...), which acts only in the
    modules that run in train mode: with the backbone in eval mode (``train.backbone_mode``, by default the method's
    reference choice: VPT, linear, Mlp-k, Partial-k) only those that train.  Skipped, at no cost, when none is asked
    for.  And a ``train.backbone_mode`` given on a backbone without any dropout, drop-path rate or BatchNorm, where it
    has nothing to act on.

    Raises:
        ConfigError: naming the option, why it cannot act, and what to do.

    """
    import torch

    from petl.model.surgery import apply
    from petl.train.engine import check_backbone_mode, enable_grad_checkpointing, is_stochastic, set_train_mode

    name = cfg.method.name
    mode = cfg.train.backbone_mode
    # The backbone's own modules, before the method adds its (prompt and LoRA dropout act in train mode anyway).
    stochastic = [m for m in model.modules() if is_stochastic(m)]
    check_backbone_mode(model, mode, "train.backbone_mode", f"model.drop_path (it is {cfg.model.drop_path:g})")
    reference = get_method(name).config_cls.backbone_mode
    chosen = _stochastic_options(cfg) if (reference if mode == "auto" else mode) == "eval" else {}
    if not (chosen or cfg.train.grad_checkpointing or not cfg.train.cache_features):
        return
    try:
        with torch.device("meta"):
            apply(model, method_cfg)
    except Exception:  # anything the meta device cannot do is left to the run, which applies the method for real
        check_cache_option_acts(cfg, None)  # its settings are known all the same
        return
    # A calibrated method's frozen front is checked once its calibration chose.
    check_cache_option_acts(cfg, model if get_method(name).calibrate is None else None)
    if cfg.train.grad_checkpointing:
        check_grad_checkpointing_acts(cfg, model)
        enable_grad_checkpointing(model)
    set_train_mode(model, "eval")
    for key, kinds in chosen.items():
        if not any(m.training for m in stochastic if isinstance(m, kinds)):
            why = f"method {name}'s reference choice" if mode == "auto" else "train.backbone_mode=eval"
            raise ConfigError(
                f"{key} cannot act: the frozen backbone runs in eval mode ({why}) and no block that trains holds "
                f"it; set train.backbone_mode=train for the backbone's dropout and drop-path, or drop {key}"
            )
