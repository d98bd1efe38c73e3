"""Reading a composed run config: the dataset's description, the method's options, the model's arguments and size.

Kept apart from :mod:`petl.train.config` (the schema and its composition); ``petl.train.config`` re-exports them.
"""

from __future__ import annotations

import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf
from timm.data import resolve_data_config

import petl.methods  # noqa: F401  (importing the methods registers them)
from petl import data as petl_data
from petl.model.registry import get_method
from petl.store.run_card import FILE_KWARGS, OVERLAY, overlay_problem
from petl.utils.checks import to_str_tuple
from petl.utils.errors import ConfigError, UnreachableError

__all__ = ["RUNNER_FIELDS", "data_info", "data_options", "image_size", "method_options", "model_kwargs"]

# Method fields the runner fills in itself (from the dataset), so they are not command-line options.
RUNNER_FIELDS = ("num_classes",)


def data_options(cfg: DictConfig) -> dict[str, Any]:
    """The dataset's own options (``data.image_column``...) that are set."""
    return {key: cfg.data[key] for key in ("image_column", "label_column") if cfg.data[key] is not None}


def data_info(cfg: DictConfig) -> petl_data.DatasetInfo:
    """The dataset's description with ``data.root`` and its options: class count and names, splits.

    Raises:
        ConfigError: a root where the dataset reads none, none where it needs one, a root that does not
            exist or cannot be used, an option the dataset does not read.
        UnreachableError: the files cannot be reached here (``data=hf``'s hub id while the hub cannot be reached).

    """
    try:
        return petl_data.describe_dataset(cfg.data.name, root=cfg.data.root, **data_options(cfg))
    except ValueError as error:
        message = str(error)
        named = message.startswith(cfg.data.name)
        raise ConfigError(message if named else f"data {cfg.data.name}: {message}") from None
    except petl_data.DatasetUnavailableError as error:
        raise UnreachableError(str(error)) from None


def method_options(cfg: DictConfig) -> dict[str, Any]:
    """The method node as keyword options for :func:`petl.model.registry.make_config`.

    Lists (the command line's form of a ``tuple[str, ...]`` field, see :func:`_cli_type`) go back
    to tuples through :func:`petl.utils.checks.to_str_tuple`, the one normaliser the configs use too.

    Raises:
        ConfigError: a field the runner fills in from the data (``+method.num_classes=4``), which the method node
            leaves out.

    """
    options = OmegaConf.to_container(cfg.method, resolve=True)
    assert isinstance(options, dict)
    name = options.pop("name")
    for key in RUNNER_FIELDS:
        if key in options:  # added with + (or a dict): make_config would get it twice, a TypeError's traceback
            raise ConfigError(
                f"method.{key}={options[key]}: the head's class count comes from the data ({cfg.data.name}'s "
                "classes): drop it"
            )
    hints = typing.get_type_hints(get_method(name).config_cls)
    for key, value in options.items():
        if typing.get_origin(hints.get(key)) is tuple and isinstance(value, list):
            options[key] = to_str_tuple(value, key)
    return options


def model_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """Keyword arguments for ``timm.create_model`` besides the name: ``model.kwargs`` plus ``model.img_size``.

    Raises:
        ConfigError: ``model.img_size`` and ``model.kwargs.img_size`` both given, with different values;
            ``model.kwargs.num_classes`` (the data sets the head's classes); a
            kwarg that makes timm load a file (``checkpoint_path``...), which the run's ``model.json`` could
            not carry (:func:`petl.store.run_card.read_card` refuses it); a ``pretrained_cfg_overlay`` other than
            ``{input_size: [3, N, N]}``, the one the card carries (a NaFlexVit's training size).

    """
    kwargs = dict(OmegaConf.to_container(cfg.model.kwargs, resolve=True))
    steering = sorted((FILE_KWARGS - {OVERLAY}) & set(kwargs))
    if steering:
        raise ConfigError(
            f"model.kwargs.{steering[0]} would make timm load a file petl does not check (the run could not be "
            "loaded): give the weights as model.checkpoint=PATH, checked by its SHA-256"
        )
    problem = overlay_problem(kwargs[OVERLAY]) if OVERLAY in kwargs else None
    if problem is not None:  # its input_size alone is carried into model.json (a NaFlexVit's training size)
        # A size not [3, N, N] is fixed in the size; any other key may be there to load weights.
        weights = "" if problem.startswith(".input_size") else "; give weights as model.checkpoint=PATH"
        raise ConfigError(f"model.kwargs.{OVERLAY}{problem}{weights}")
    if "num_classes" in kwargs:
        # petl.apply resets the head to the data's class count: this one would only shift the random stream.
        raise ConfigError(
            f"model.kwargs.num_classes={kwargs['num_classes']}: the head's class count comes from the data "
            f"({cfg.data.name}'s classes): drop it"
        )
    size = cfg.model.img_size
    if size is not None:
        if kwargs.get("img_size", size) != size:
            raise ConfigError(
                f"model.img_size={size} and model.kwargs.img_size={kwargs['img_size']} disagree: give one of them"
            )
        kwargs["img_size"] = size
    return kwargs


def image_size(model: Any) -> int:
    """The side of the square images ``model`` takes: its patch embedding's size, else its pretrained config's.

    Raises:
        ConfigError: a size the data pipeline cannot feed (not square, not a multiple of the patch size).

    """
    patch_embed = getattr(model, "patch_embed", None)
    size = getattr(patch_embed, "img_size", None)
    if size is None:  # a model built for any size (timm's dynamic_img_size): its pretrained config's size
        return int(resolve_data_config({}, model=model)["input_size"][-1])
    height, width = (size, size) if isinstance(size, int) else size
    if height != width:
        raise ConfigError(f"model img_size {height}x{width} is not square: petl's images are square (model.img_size=N)")
    patch = patch_embed.patch_size
    patch = patch if isinstance(patch, int) else patch[0]
    if getattr(patch_embed, "strict_img_size", False) and height % patch:
        raise ConfigError(f"model.img_size={height} is not a multiple of the patch size {patch}: choose one that is")
    return int(height)


def check_built_size(model: Any, name: str, asked: Any, key: str = "model.img_size") -> int:
    """:func:`image_size` of ``model`` (``name``, built with ``img_size=asked``, given as ``key``), checked to be the
    size asked.

    Raises:
        ConfigError: a model that takes ``img_size`` and sizes itself otherwise (timm's NaFlexVit: its position grid
            by ``pos_embed_grid_size``, its images by its pretrained config), which would run at another size.

    """
    built = image_size(model)
    if asked is not None and list(asked if isinstance(asked, list | tuple) else (asked, asked)) != [built, built]:
        # petl-run's way to another size there: the pretrained config's input_size, which model.json carries.
        side = asked[-1] if isinstance(asked, list | tuple) else asked
        instead = f"; for {side} px give +model.kwargs.{OVERLAY}={{input_size:[3,{side},{side}]}}"
        raise ConfigError(
            f"{key}={asked}: {name} is built for {built} px whatever img_size says (timm resamples its position "
            f"grid to any size): drop {key}{instead if key.startswith('model.') else ''}"
        )
    return built


def check_overlay_size(built: int, name: str, kwargs: dict[str, Any]) -> None:
    """Refuse a ``pretrained_cfg_overlay`` input size the model built at ``built`` px does not take.

    A model with a fixed patch embedding (a ViT) is built for its ``img_size``; the overlay's input size would
    only be written into its pretrained config, which petl does not read for it: an option with no effect.

    Raises:
        ConfigError: the overlay's size is not ``built``, naming ``model.img_size`` as the way to that size.

    """
    size = (kwargs.get(OVERLAY) or {}).get("input_size")
    if size is not None and size[-1] != built:
        raise ConfigError(
            f"model.kwargs.{OVERLAY}.input_size={list(size)}: {name} is built for {built} px by its img_size, "
            f"which the overlay does not change: give model.img_size={size[-1]} instead"
        )
