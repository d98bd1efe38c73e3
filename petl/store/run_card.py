"""The run card (model.json): everything needed to use a trained run, its one writer and reader, and :func:`load_run`,
which uses it.

A finished run's folder holds ``model.json`` (the run card) beside ``trainable.safetensors``: the
backbone (timm name with its pretrained tag, every ``timm.create_model`` argument the run gave it,
``img_size`` included, whether its pretrained weights or a local checkpoint were loaded, the checkpoint
as an absolute path with its SHA-256, the seed that drew a random init), the preprocessing (input size,
mean/std, interpolation, crop), the method, the class names, and SHA-256s of the trained weights file
and of the frozen backbone's tensors.  Loading checks each: a weights file that is not the run's, a
backbone rebuilt otherwise (hub weights that changed, another timm version drawing another random
init), a checkpoint file that changed, a head of another class count, a ``weights`` naming a file
outside the run folder are refused in one line instead of silently giving other predictions.

:func:`write_card` is the card's one writer and :func:`read_card` its one reader.  The card records a SHA-256 of its
own fields (``card_sha256``, :func:`card_hash`), which :func:`read_card` checks: the class names and preprocessing
are checked against nothing else, and an edited one would give other predictions silently.  Cards written before it
hold none and are read as before.  A card of the first
format (``petl-model-1``: no weights hash, no ``img_size``) still loads, with one line saying what
could not be checked; one of a newer format than this petl knows is refused, saying so.  From format 3 on,
``backbone.kwargs`` may hold ``pretrained_cfg_overlay={"input_size": [3, N, N]}`` (N the card's input size): the
size a NaFlexVit, which sizes its images by its pretrained config, was trained at; older cards never held it.

    run = petl.load_run("runs/folder/.../seed0")
    logits = run.model(run.preprocess(PIL.Image.open("cat.png"))[None])
    print(run.class_names[int(logits.argmax())])
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
from PIL import Image
from torch import nn

import petl.backbones  # noqa: F401  (registers petl's timm models, which a run's card may name)
import petl.methods  # noqa: F401  (importing the methods registers them)
from petl.data import hub
from petl.data.images import to_uint8
from petl.data.transforms import ImageSpec, pil_to_tensor
from petl.model.backbone import backbone_of
from petl.model.io import load_trainable, read_trainable_metadata
from petl.model.params import trainable_state
from petl.model.registry import get_method
from petl.store.files import (
    MODEL_FILE,
    RESULT_FILE,
    SEARCH_DIR,
    WEIGHTS_FILE,
    exported_not_run,
    file_not_run,
    newer_file,
    unfinished_run,
    write_json,
)
from petl.utils.checks import is_finite_number
from petl.utils.paths import file_sha256

log = logging.getLogger(__name__)

VERSION = 3  # of the card's format; read_card reads this one and every older one
FORMAT = f"petl-model-{VERSION}"
_FORMAT_PATTERN = re.compile(r"petl-model-([1-9][0-9]*)")  # formats count from 1

# Every field a card must hold, with its JSON type ("int" never a bool); fields of later versions after.
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "backbone": dict,
    "backbone.name": str,
    "backbone.pretrained": bool,
    "backbone.kwargs": dict,
    "method": str,
    "method_config": dict,
    "weights": str,
    "preprocess": dict,
    "preprocess.input_size": int,
    "preprocess.mean": list,
    "preprocess.std": list,
    "preprocess.interpolation": str,
    "preprocess.crop": bool,
    "num_classes": int,
    "class_names": list,
}
_OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "backbone.checkpoint": (str, type(None)),
    "backbone.checkpoint_sha256": (str, type(None)),
    "backbone.seed": int,
    "backbone.frozen_sha256": (str, type(None)),
    "dataset": str,  # what the model was trained on; petl-export copies it into the exported model's metadata
    "card_sha256": str,  # card_hash, which read_card checks; cards written before it have none
}
_FIELDS_SINCE = {2: {"weights_sha256": str, "backbone.kwargs.img_size": int}}
# timm.create_model's arguments that name a file or a place to load weights from.  A card never steers file
# loading: the one file it may name is backbone.checkpoint, checked by its SHA-256 (create_backbone).
FILE_KWARGS = frozenset({"pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path", "cache_dir"})
# The one pretrained_cfg_overlay petl takes (card format 3 on): {"input_size": [3, N, N]}, the size a model that
# sizes its images by its pretrained config (timm's NaFlexVit) is built for.  Its other keys could name a file
# (file, url, hf_hub_id) or change what the card does not record.
OVERLAY = "pretrained_cfg_overlay"
OVERLAY_SINCE = 3


def overlay_problem(overlay: Any) -> str | None:
    """What keeps ``overlay`` (a ``pretrained_cfg_overlay``) from being ``{"input_size": [3, N, N]}``, or ``None``.

    Returns:
        A phrase to follow the field's name (``.file: petl takes only input_size of it``).

    """
    if not isinstance(overlay, dict):
        return f"={json.dumps(overlay)[:60]} is not a mapping: petl takes only {{input_size: [3, N, N]}}"
    other = sorted(set(overlay) - {"input_size"})
    if other:
        return (
            f".{other[0]}: petl takes only input_size of it (other keys could make timm load a file petl does not "
            "check, or change the model in ways model.json does not record)"
        )
    size = overlay.get("input_size")
    square = isinstance(size, list | tuple) and len(size) == 3 and size[0] == 3 and size[1] == size[2]
    if not square or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size):
        return f".input_size={json.dumps(size)[:60]} is not [3, N, N] (petl's images are square RGB)"
    return None


class RunFolderError(ValueError):
    """A run folder that cannot be loaded (no weights, no model.json, a backbone that does not match)."""


def frozen_sha256(model: nn.Module) -> str:
    """SHA-256 over every tensor of ``model`` that is not trained state (the frozen backbone), by name."""
    trained = set(trainable_state(model))
    digest = hashlib.sha256()
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name in sorted(tensors):
        if name in trained:
            continue
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def model_card(
    *,
    model_cfg: dict[str, Any],
    seed: int,
    model: nn.Module,
    spec: ImageSpec,
    class_names: Sequence[str],
    dataset: str,
    checkpoint_sha256: str | None,
) -> dict[str, Any]:
    """The ``model.json`` record of a trained model (see the module docstring).

    Args:
        model_cfg: the run's resolved ``model`` node (name, pretrained, checkpoint, kwargs, drop_path).
        seed: the run's seed (it drew the backbone's random init when not pretrained).
        model: the trained model, method applied, not merged.
        spec: the evaluation preprocessing.
        class_names: one name per class, in label order.
        dataset: the dataset name it was trained on.
        checkpoint_sha256: SHA-256 of ``model_cfg["checkpoint"]``, if one was loaded.

    Returns:
        The card without ``weights_sha256``, which :func:`write_card` adds once the weights are on disk.

    """
    checkpoint = model_cfg.get("checkpoint")
    return {
        "format": FORMAT,
        "backbone": {
            "name": model_cfg["name"],
            "pretrained": bool(model_cfg["pretrained"]),
            # Absolute: a run is loaded from other working folders than the one it was trained in.
            "checkpoint": str(Path(checkpoint).resolve()) if checkpoint else None,
            "checkpoint_sha256": checkpoint_sha256,
            # Every create_model argument, the built size included (model.img_size or kwargs.img_size or the
            # default): the position grid's shape depends on it.
            "kwargs": {**dict(model_cfg.get("kwargs") or {}), "img_size": int(spec.image_size)},
            "seed": seed,
            "frozen_sha256": frozen_sha256(model),
        },
        "method": model.petl_method,
        "method_config": dataclasses.asdict(model.petl_config),
        "weights": WEIGHTS_FILE,
        "preprocess": {
            "input_size": spec.image_size,
            "mean": list(spec.mean),
            "std": list(spec.std),
            "interpolation": spec.interpolation,
            "crop": spec.crop,
        },
        "num_classes": len(class_names),
        "class_names": list(class_names),
        "dataset": dataset,
    }


def write_card(folder: Path, card: dict[str, Any]) -> None:
    """Write a run's ``model.json`` (atomically), with the SHA-256 of the weights file already written beside it.

    Args:
        folder: the run folder; its ``card["weights"]`` file must be written first.
        card: a record of :func:`model_card`.

    """
    card = json.loads(json.dumps({**card, "weights_sha256": file_sha256(folder / card["weights"])}, default=str))
    write_json(folder / MODEL_FILE, {**card, CARD_HASH: card_hash(card)})


# The card's field holding :func:`card_hash`, as a weights file's metadata holds its own (petl.model.io.METADATA_HASH).
CARD_HASH = "card_sha256"


def card_hash(card: dict[str, Any]) -> str:
    """SHA-256 of a card's every field but this hash's own: class names and preprocessing, which nothing else checks,
    included.
    """
    described = {key: value for key, value in card.items() if key != CARD_HASH}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


@dataclass
class LoadedRun:
    """A trained run ready to predict.

    Attributes:
        model: the backbone with the method applied and the trained tensors loaded, in eval mode.
        spec: the preprocessing the model was evaluated with (input size, mean/std, interpolation, crop).
        class_names: one name per output, in label order.
        card: the run's ``model.json`` record.
        run_dir: the folder it came from.

    """

    model: nn.Module
    spec: ImageSpec
    class_names: list[str]
    card: dict[str, Any]
    run_dir: Path

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """One decoded image (any mode) as the model's input ``[3, size, size]``, its pixels those petl-run trained on.

        A 16-bit greyscale image is scaled to 8 bits as petl-run and petl-predict read it (``Image.convert`` alone
        clips it to nearly white); a floating-point one (mode ``F``) raises ``ValueError``, as they refuse it.
        """
        return pil_to_tensor(Image.fromarray(to_uint8(image)), self.spec)


def read_card(run_dir: str | Path) -> dict[str, Any]:
    """A run folder's ``model.json``, checked: its format, every field and its type, ``weights`` inside the folder.

    A card of an older format is brought to the current one in memory (the file is left as it is): a
    ``petl-model-1`` card's ``kwargs.img_size`` is its preprocessing's input size (the size its backbone was
    built at); it records no weights hash, which one logged line says.

    Raises:
        RunFolderError: the folder, its weights or its model.json is missing, the run is unfinished
            (:func:`petl.store.files.unfinished_run`), or the card is damaged, of a newer format, or names weights
            outside the folder (one line naming the file or field).

    """
    folder = Path(run_dir)
    if folder.is_file():
        raise RunFolderError(file_not_run(folder, str(folder)))
    if not folder.is_dir():
        raise RunFolderError(f"{folder}: no such run folder")
    unfinished = unfinished_run(folder) or exported_not_run(folder)
    if unfinished is not None:
        raise RunFolderError(unfinished)
    card_path = folder / MODEL_FILE
    if not card_path.is_file():
        if not (folder / WEIGHTS_FILE).is_file():
            raise RunFolderError(
                f"{folder} holds no {WEIGHTS_FILE}: not a finished petl-run folder; give the output_dir of a "
                "petl-run that finished"
            )
        raise RunFolderError(
            f"{folder} holds no {MODEL_FILE} (written by petl-run from this version on): train it again to use it"
        )
    try:
        card = json.loads(card_path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RunFolderError(f"{card_path} is not valid JSON ({error}): restore the run's model.json") from None
    found = _FORMAT_PATTERN.fullmatch(str(card.get("format"))) if isinstance(card, dict) else None
    if found is None:
        raise RunFolderError(
            f"{card_path} is not a petl model record (its format is not petl-model-N, N from 1): restore the run's "
            "model.json as petl-run wrote it"
        )
    version = int(found.group(1))
    if version > VERSION:
        newer = newer_file(card_path, f"format {card['format']}", FORMAT)
        raise RunFolderError(f"{newer}: upgrade petl to load it")
    if version == 1:
        card = _upgraded_from_1(card, card_path)
    _check_fields(card, card_path, version)
    # After the fields (one of a wrong type is named as such), before any is compared or used: an edited class name
    # or mean would otherwise give other predictions, silently.
    if CARD_HASH in card and card[CARD_HASH] != card_hash(card):
        raise RunFolderError(
            f"{card_path} was edited since petl-run wrote it (its fields do not match its {CARD_HASH}): restore the "
            "run's model.json"
        )
    if len(card["class_names"]) != card["num_classes"]:
        raise RunFolderError(
            f"{card_path}: class_names has {len(card['class_names'])} names for num_classes={card['num_classes']}: "
            "restore the run's model.json"
        )
    problem = _preprocess_problem(card)
    if problem is not None:
        raise RunFolderError(f"{card_path}: {problem}: restore the run's model.json")
    if card["preprocess"]["input_size"] != card["backbone"]["kwargs"]["img_size"]:
        # petl-run writes both from the size it built (an old card's img_size is its input_size): images of another
        # size stop the backbone's first layer with an assertion, after the images are decoded.
        raise RunFolderError(
            f"{card_path}: field preprocess.input_size is {card['preprocess']['input_size']}, the backbone is built at "
            f"backbone.kwargs.img_size={card['backbone']['kwargs']['img_size']}: restore the run's model.json"
        )
    problem = _kwargs_problem(card, version)
    if problem is not None:
        raise RunFolderError(f"{card_path}: {problem}: restore the run's model.json")
    try:
        get_method(card["method"])
    except ValueError as error:
        raise RunFolderError(f"{card_path}: method: {error}: restore the run's model.json") from None
    weights = Path(card["weights"])
    inside = folder.resolve()
    if weights.is_absolute() or not (inside / weights).resolve().is_relative_to(inside):
        raise RunFolderError(
            f"{card_path}: weights={card['weights']} names a file outside the run folder; petl opens only the "
            f"run's own ({WEIGHTS_FILE}): restore the run's model.json"
        )
    if not (folder / weights).is_file():
        if folder.parent.name == SEARCH_DIR and (folder / RESULT_FILE).is_file():
            # "Restore it from the run, or train the run again" sent the user after weights petl-bench removed.
            raise RunFolderError(
                f"{folder} is a petl-bench selection trial, whose weights petl-bench removes once it is scored (the "
                f"final runs retrain the chosen point): use a final run, {folder.parent.parent / 'seed0'}"
            )
        raise RunFolderError(
            f"{folder} holds no {weights}, which its model.json names: restore it from the run, or train the run again"
        )
    try:
        metadata = read_trainable_metadata(folder / weights)
        trained, options = metadata["method"], metadata["config"]
    except ValueError:  # a damaged weights file: its hash (weights_file) and load_trainable name what is wrong
        trained, options = card["method"], card["method_config"]
    if trained != card["method"]:
        raise RunFolderError(
            f"{card_path}: method is {card['method']!r}, {weights} holds {trained!r}: restore the run's model.json"
        )
    # The model is built from the weights' config; a card saying other options would describe another model.
    differ = sorted(k for k in {*options, *card["method_config"]} if options.get(k) != card["method_config"].get(k))
    if differ:
        key = differ[0]
        raise RunFolderError(
            f"{card_path}: method_config.{key} is {json.dumps(card['method_config'].get(key))[:60]}, {weights} was "
            f"trained with {json.dumps(options.get(key))[:60]}: restore the run's model.json"
        )
    return card


# Run folders whose old card was already noted (predict reads a card more than once).
_NOTED: set[Path] = set()


def _upgraded_from_1(card: dict[str, Any], card_path: Path) -> dict[str, Any]:
    """A ``petl-model-1`` card in the current format (in memory), and one logged line on what it cannot check."""
    card = json.loads(json.dumps(card))  # a copy
    backbone, preprocess = card.get("backbone"), card.get("preprocess")
    if isinstance(backbone, dict) and isinstance(backbone.get("kwargs"), dict) and isinstance(preprocess, dict):
        # Its evaluation size was the built backbone's size: the one argument version 1 could leave out.
        backbone["kwargs"].setdefault("img_size", preprocess.get("input_size"))
    if card_path.resolve() not in _NOTED:
        _NOTED.add(card_path.resolve())
        log.warning(
            "%s is a petl-model-1 card: it records no hash of %s, so that file is not checked to be this run's "
            "(train the run again for a card that does)",
            card_path,
            card.get("weights", WEIGHTS_FILE),
        )
    card["weights_sha256"] = None
    return card


def _check_fields(card: dict[str, Any], card_path: Path, version: int) -> None:
    """Refuse a card with a field missing or of another type (one line naming it)."""
    required = dict(_FIELDS)
    for since, fields in _FIELDS_SINCE.items():
        if version >= since:
            required.update(fields)
    for name, kind in [*required.items(), *_OPTIONAL.items()]:
        value, present = card, True
        for key in name.split("."):
            present = isinstance(value, dict) and key in value
            value = value[key] if present else None
        if not present:
            if name in required:
                raise RunFolderError(f"{card_path}: field {name} is missing: restore the run's model.json")
            continue
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            wanted = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise RunFolderError(
                f"{card_path}: field {name} is {json.dumps(value)[:60]}, not a {wanted}: restore the run's model.json"
            )


def _kwargs_problem(card: dict[str, Any], version: int) -> str | None:
    """What is wrong with a card's ``backbone.kwargs`` that steer timm's loading, or ``None``.

    From format 3 on, a ``pretrained_cfg_overlay`` of the card's own input size alone is the run's (petl-run
    writes it from ``model.kwargs``); every other such argument, and any in an older card, was put there by hand.
    """
    kwargs = card["backbone"]["kwargs"]
    for key in sorted(FILE_KWARGS & set(kwargs)):
        if key != OVERLAY:
            return (
                f"backbone.kwargs.{key} would make timm load a file the card names; petl loads only "
                "backbone.checkpoint, checked by its SHA-256"
            )
        if version < OVERLAY_SINCE:
            return f"backbone.kwargs.{key} is in a petl-model-{version} card, which petl never wrote with one"
        problem = overlay_problem(kwargs[key])
        if problem is not None:
            return f"backbone.kwargs.{key}{problem}"
        size = card["preprocess"]["input_size"]
        if kwargs[key]["input_size"] != [3, size, size]:
            return (
                f"backbone.kwargs.{key}.input_size is {kwargs[key]['input_size']}, not the [3, {size}, {size}] of "
                "preprocess.input_size"
            )
    return None


def _preprocess_problem(card: dict[str, Any]) -> str | None:
    """What is wrong with a card's class names or preprocessing values (their types are checked), or ``None``.

    A NaN mean (JSON allows it) would make every prediction silently class 0; a text std would fail deep in torch.
    """
    if not all(isinstance(name, str) for name in card["class_names"]):
        return "field class_names holds a name that is not text"
    pre = card["preprocess"]
    for key in ("mean", "std"):
        if not all(is_finite_number(v) for v in pre[key]):
            return f"field preprocess.{key} is {json.dumps(pre[key])[:60]}, not finite numbers"
    try:
        spec_of(card)
    except ValueError as error:  # ImageSpec's own checks: 3 values each, std > 0, a known interpolation, a size
        return f"field preprocess: {error}"
    return None


def spec_of(card: dict[str, Any]) -> ImageSpec:
    """The evaluation preprocessing a model record names."""
    pre = card["preprocess"]
    return ImageSpec(
        image_size=int(pre["input_size"]),
        mean=tuple(pre["mean"]),
        std=tuple(pre["std"]),
        interpolation=pre["interpolation"],
        crop=bool(pre["crop"]),
    )


def create_backbone(backbone: dict[str, Any], card_path: str | Path = MODEL_FILE) -> nn.Module:
    """The frozen timm backbone a model record names, built as petl-run built it (weights or seeded init).

    Args:
        backbone: the card's ``backbone`` record (read by :func:`read_card`).
        card_path: the card it came from, named in the errors.

    Raises:
        RunFolderError: a name timm does not know, ``kwargs`` it cannot build the model with, a checkpoint that
            is gone or changed (one line naming ``card_path`` and the field).

    """
    name = backbone["name"]
    if not timm.is_model(name):
        raise RunFolderError(
            f"{card_path}: backbone.name {name!r} is not a model timm {timm.__version__} knows: install the "
            "timm (and petl) the run was trained with, or restore the run's model.json"
        )
    kwargs = dict(backbone.get("kwargs") or {})
    given = json.dumps(kwargs)[:200]
    checkpoint = backbone.get("checkpoint")
    if checkpoint:
        if not Path(checkpoint).is_file():
            raise RunFolderError(f"the backbone's weights file {checkpoint} is gone: put it back to load this run")
        recorded = backbone.get("checkpoint_sha256")
        if recorded and file_sha256(Path(checkpoint)) != recorded:
            raise RunFolderError(
                f"the backbone's weights file {checkpoint} changed since the run (its sha256 is not "
                "backbone.checkpoint_sha256): put back the file the run was trained with"
            )
        # Beside the run's own overlay (its input_size), which the file does not replace.
        kwargs[OVERLAY] = {**kwargs.get(OVERLAY, {}), "file": str(checkpoint)}
    # The same generator state petl-run had when it built the backbone (a random init is drawn from it),
    # without disturbing the caller's.
    with torch.random.fork_rng(devices=[]), hub.offline_unless_reachable():
        torch.manual_seed(int(backbone.get("seed", 0)))
        try:
            return timm.create_model(name, pretrained=bool(backbone["pretrained"]), **kwargs)
        except (TypeError, ValueError, AssertionError) as error:  # an argument the architecture does not take
            why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise RunFolderError(
                f"{card_path}: backbone.kwargs {given} cannot build {name} ({why}): restore the run's model.json"
            ) from None


def backbone_difference(first: dict[str, Any], other: dict[str, Any]) -> str | None:
    """The first field in which two cards' ``backbone`` records differ (``None``: the same backbone).

    The seed counts only for a random init.  The frozen tensors' hashes are not compared: each is taken over the
    run's model with its method applied, whose wrappers rename the layers they wrap (LoRA's ``qkv.base.weight``),
    so runs of two methods on one backbone record different hashes.  Each run's hash is checked against the
    backbone once it is built (:func:`frozen_mismatch`).
    """
    keys = ["name", "pretrained", "checkpoint_sha256", "kwargs"]
    if not first.get("pretrained"):
        keys.append("seed")
    for key in keys:
        a, b = first.get(key), other.get(key)
        if key == "kwargs":
            for arg in sorted({*a, *b}):
                if a.get(arg) != b.get(arg):
                    return f"backbone.kwargs.{arg} {a.get(arg)} against {b.get(arg)}"
        elif a != b:
            return f"backbone.{key} {a} against {b}"
    return None


def backbone_mismatch(card: dict[str, Any], backbone: nn.Module) -> str | None:
    """How a plain timm backbone differs from the one a run's card records: architecture or image size.

    Returns:
        One phrase (``trained on vit_x at 48 px, this backbone is vit_x at 32 px``), or ``None``.  The frozen
        tensors themselves are compared once the run is loaded on it (:func:`frozen_mismatch`).

    """
    recorded = card["backbone"]
    name, size = recorded["name"].split(".", 1)[0], recorded["kwargs"].get("img_size")
    have_name = (getattr(backbone, "pretrained_cfg", None) or {}).get("architecture") or name
    have_size = getattr(getattr(backbone, "patch_embed", None), "img_size", None)
    have_size = have_size[0] if isinstance(have_size, (tuple, list)) else have_size
    if have_name != name or (size is not None and have_size is not None and have_size != size):
        return f"trained on {name} at {size} px, this backbone is {have_name} at {have_size} px"
    return None


def frozen_mismatch(card: dict[str, Any], model: nn.Module) -> str | None:
    """Why ``model`` (a run's method loaded on some backbone) is not on the backbone it trained on; ``None``: it is."""
    recorded = card["backbone"].get("frozen_sha256")
    if recorded is not None and frozen_sha256(model) != recorded:
        # petl trains on float32 frozen weights and hashes them with their dtype: a backbone cast before the run was
        # loaded on it (MultiTask(backbone.to(torch.bfloat16), runs)) was said to hold other pretrained weights.
        cast = sorted({str(t.dtype) for t in model.parameters() if t.is_floating_point() and t.dtype != torch.float32})
        if cast:
            return (
                f"the backbone's weights are {cast[0].removeprefix('torch.')}, and the run's card checks the float32 "
                f"ones it trained on: give the backbone in float32, and cast the model once loaded (.to({cast[0]}))"
            )
        return (
            f"the backbone's frozen tensors differ from those {card['backbone']['name']} had in training "
            "(other pretrained weights, checkpoint or random init)"
        )
    return None


def checkpoint_mismatch(model_name: str, kwargs: dict[str, Any], path: str | Path, shown: int = 3) -> str | None:
    """Why a weights file does not fit a timm architecture: its first missing, unexpected and mis-shaped keys.

    Args:
        model_name: the timm name the file was given for.
        kwargs: the ``timm.create_model`` keyword arguments of the run.
        path: a safetensors file or a torch checkpoint (a state dict, possibly under ``state_dict``/``model``).
        shown: how many keys of each kind to name.

    Returns:
        One phrase naming them in the model's key order, or ``None`` when names and shapes all fit.

    """
    return _mismatch(_meta_shapes(model_name, kwargs), _file_shapes(Path(path)), "the file", shown)


def kwargs_mismatch(model_name: str, kwargs: dict[str, Any], changed: dict[str, Any], shown: int = 3) -> str | None:
    """Why timm keyword arguments make an architecture the pretrained weights of ``model_name`` do not fit.

    The weights are those of the architecture built without ``changed`` (its other ``kwargs``, such as the image
    size whose position grid timm resamples, kept): comparing the two on the meta device names what the load lacks.

    Args:
        model_name: the timm name (with its pretrained tag).
        kwargs: every ``timm.create_model`` keyword argument of the run, ``changed`` included.
        changed: the user's ``model.kwargs`` that alter the architecture.
        shown: how many keys of each kind to name.

    Returns:
        One phrase naming the first missing, unexpected and mis-shaped keys, or ``None`` when all fit.

    """
    plain = {key: value for key, value in kwargs.items() if key not in changed}
    return _mismatch(_meta_shapes(model_name, kwargs), _meta_shapes(model_name, plain), "the weights", shown)


def _meta_shapes(model_name: str, kwargs: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):  # shapes only: no memory, no weights
        model = timm.create_model(model_name, pretrained=False, **kwargs)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _mismatch(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], where: str, shown: int
) -> str | None:
    """The first mis-shaped, missing and unexpected keys of ``found`` against the model's ``expected``."""
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    shapes = [
        f"{name} {list(found[name])} in {where}, {list(expected[name])} in the model"
        for name in expected
        if name in found and found[name] != expected[name]
    ]
    parts = []
    if shapes:
        parts.append("shape " + "; ".join(shapes[:shown]))
    if missing:
        parts.append(
            f"missing {', '.join(missing[:shown])}" + (f" (+{len(missing) - shown})" if len(missing) > shown else "")
        )
    if unexpected:
        more = f" (+{len(unexpected) - shown})" if len(unexpected) > shown else ""
        parts.append(f"unexpected {', '.join(unexpected[:shown])}{more}")
    return "; ".join(parts) or None


def _file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    return {name: tuple(t.shape) for name, t in state.items() if isinstance(t, torch.Tensor)}


def load_run(run_dir: str | Path) -> LoadedRun:
    """The trained model of a ``petl-run`` folder, ready to predict.

    Args:
        run_dir: a finished run's ``output_dir`` (it holds ``trainable.safetensors`` and ``model.json``).

    Returns:
        A :class:`LoadedRun`: ``model`` (method applied, trained tensors loaded, eval mode), ``spec`` and
        ``preprocess`` (the evaluation transform), ``class_names``.

    Raises:
        RunFolderError: a missing file, or a rebuilt backbone whose frozen tensors differ from the trained
            one's (its weights changed since).
        ValueError: trained weights that do not fit the backbone (from :func:`petl.load_trainable`).

    """
    folder = Path(run_dir)
    card = read_card(folder)
    model = create_backbone(card["backbone"], folder / MODEL_FILE)
    # The card's frozen_sha256 (every value, checked by loaded) says it as the run's; an older card has none.
    load_trainable(model, weights_file(folder, card), check_frozen=card["backbone"].get("frozen_sha256") is None)
    return loaded(folder, card, model)


def weights_file(folder: Path, card: dict[str, Any]) -> Path:
    """The trained tensors a run folder's card names (read by :func:`read_card`), checked to be the run's own.

    Raises:
        RunFolderError: the file's SHA-256 is not the card's ``weights_sha256`` (another run's weights, or changed).

    """
    path = folder / card["weights"]
    recorded = card.get("weights_sha256")
    if recorded is not None and file_sha256(path) != recorded:
        raise RunFolderError(
            f"{path} is not the weights this run wrote (its sha256 is not {MODEL_FILE}'s weights_sha256): "
            "put back the run's own file"
        )
    return path


def loaded(folder: Path, card: dict[str, Any], model: nn.Module) -> LoadedRun:
    """The :class:`LoadedRun` of ``model`` (built from ``card``), once its frozen tensors are checked against it.

    Raises:
        RunFolderError: the rebuilt backbone's frozen tensors differ from those the run trained on.

    """
    bb = backbone_of(model)
    mismatch = frozen_mismatch(card, model)
    if mismatch is not None:
        raise RunFolderError(f"{folder}: {mismatch}: predictions would not be the run's")
    if bb.num_classes() != card["num_classes"]:
        raise RunFolderError(
            f"{folder}: {card['weights']} holds a head of {bb.num_classes()} classes, {MODEL_FILE} says "
            f"num_classes={card['num_classes']}: put back the run's own files"
        )
    model.eval()
    names = [str(name) for name in card["class_names"]]
    return LoadedRun(model=model, spec=spec_of(card), class_names=names, card=card, run_dir=folder)
