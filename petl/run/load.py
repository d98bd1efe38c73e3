"""Everything needed to use a trained run, and :func:`load_run`, which uses it.

A finished run's folder holds ``model.json`` beside ``trainable.safetensors``: the backbone (timm
name with its pretrained tag, whether its pretrained weights or a local checkpoint were loaded, the
seed that drew a random init), the preprocessing (input size, mean/std, interpolation, crop), the
method, and the class names.  It also holds a SHA-256 of the frozen backbone's tensors, so a backbone
rebuilt later (hub weights that changed, another timm version drawing another random init) is
refused instead of silently giving other predictions.

    run = petl.load_run("runs/folder/.../seed0")
    logits = run.model(run.preprocess(PIL.Image.open("cat.png"))[None])
    print(run.class_names[int(logits.argmax())])
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
from PIL import Image
from torch import nn

import petl
from petl.core import trainable_state
from petl.data import hub
from petl.data.transforms import ImageSpec, pil_to_tensor
from petl.run.records import MODEL_FILE, WEIGHTS_FILE

FORMAT = "petl-model-1"


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

    """
    return {
        "format": FORMAT,
        "backbone": {
            "name": model_cfg["name"],
            "pretrained": bool(model_cfg["pretrained"]),
            "checkpoint": model_cfg.get("checkpoint"),
            "checkpoint_sha256": checkpoint_sha256,
            "kwargs": dict(model_cfg.get("kwargs") or {}),
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
        """One decoded image (any mode) as the model's input ``[3, size, size]``."""
        return pil_to_tensor(image, self.spec)


def read_card(run_dir: str | Path) -> dict[str, Any]:
    """A run folder's ``model.json``, checked to exist beside the weights.

    Raises:
        RunFolderError: the folder, its weights or its model.json is missing (one line naming it).

    """
    folder = Path(run_dir)
    if not folder.is_dir():
        raise RunFolderError(f"{folder}: no such run folder")
    if not (folder / WEIGHTS_FILE).is_file():
        raise RunFolderError(f"{folder} holds no {WEIGHTS_FILE}: not a finished petl-run folder")
    card_path = folder / MODEL_FILE
    if not card_path.is_file():
        raise RunFolderError(
            f"{folder} holds no {MODEL_FILE} (written by petl-run from this version on): train it again to use it"
        )
    try:
        card = json.loads(card_path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise RunFolderError(f"{card_path} is not valid JSON ({error})") from None
    if not isinstance(card, dict) or card.get("format") != FORMAT:
        raise RunFolderError(f"{card_path} is not a petl model record (format {FORMAT})")
    return card


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


def create_backbone(backbone: dict[str, Any]) -> nn.Module:
    """The frozen timm backbone a model record names, built as petl-run built it (weights or seeded init)."""
    kwargs = dict(backbone.get("kwargs") or {})
    checkpoint = backbone.get("checkpoint")
    if checkpoint:
        if not Path(checkpoint).is_file():
            raise RunFolderError(f"the backbone's weights file {checkpoint} is gone: put it back to load this run")
        kwargs["pretrained_cfg_overlay"] = {"file": str(checkpoint)}
    # The same generator state petl-run had when it built the backbone (a random init is drawn from it),
    # without disturbing the caller's.
    with torch.random.fork_rng(devices=[]), hub.offline_unless_reachable():
        torch.manual_seed(int(backbone.get("seed", 0)))
        return timm.create_model(backbone["name"], pretrained=bool(backbone["pretrained"]), **kwargs)


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
    with torch.device("meta"):  # shapes only: no memory, no weights
        model = timm.create_model(model_name, pretrained=False, **kwargs)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    found = _file_shapes(Path(path))
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    shapes = [
        f"{name} {list(found[name])} in the file, {list(expected[name])} in the model"
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
    model = create_backbone(card["backbone"])
    petl.load_trainable(model, weights_file(folder, card))
    return loaded(folder, card, model)


def weights_file(folder: Path, card: dict[str, Any]) -> Path:
    """The trained tensors a run folder's record names."""
    return folder / card.get("weights", WEIGHTS_FILE)


def loaded(folder: Path, card: dict[str, Any], model: nn.Module) -> LoadedRun:
    """The :class:`LoadedRun` of ``model`` (built from ``card``), once its frozen tensors are checked against it.

    Raises:
        RunFolderError: the rebuilt backbone's frozen tensors differ from those the run trained on.

    """
    recorded = card["backbone"].get("frozen_sha256")
    if recorded is not None and frozen_sha256(model) != recorded:
        raise RunFolderError(
            f"{folder}: the backbone {card['backbone']['name']} built now differs from the one this run trained "
            "(its pretrained weights or timm's random init changed): predictions would not be the run's"
        )
    model.eval()
    names = [str(name) for name in card.get("class_names") or range(card["num_classes"])]
    return LoadedRun(model=model, spec=spec_of(card), class_names=names, card=card, run_dir=folder)
