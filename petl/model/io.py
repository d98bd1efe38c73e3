"""Saving and loading trained weights: only the trained tensors, with the method and its config as metadata.

Files are safetensors (nothing is ever unpickled) and carry a SHA-256 of their tensors and one of their metadata
(the method, its options and the backbone they were saved for, with the tensors' hash), which :func:`load_trainable`
checks: safetensors itself has no checksum.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

from petl.model.backbone import backbone_of
from petl.model.params import content_hash, frozen_fingerprint, trainable_state, trained_by_an_earlier_method
from petl.model.surgery import apply, meta_copy
from petl.store.files import WEIGHTS_FILE, newer_file, write_atomic

# Version 2 adds ``widths`` (each block's width: a Swin's change per stage); version 1 files, which record one
# ``embed_dim`` for every block, are still read.
FORMAT = "petl-trainable-2"
FORMATS = ("petl-trainable-1", FORMAT)


def _describe(model: nn.Module) -> dict[str, str]:
    bb = backbone_of(model)
    config = model.petl_config
    return {
        "format": FORMAT,
        "method": model.petl_method,
        "config": json.dumps(dataclasses.asdict(config), sort_keys=True),
        "embed_dim": str(bb.widths()[0]),
        "depth": str(bb.depth()),
        "widths": json.dumps(bb.widths()),
        # The backbone family (a SwinV2's LoRA has a Swin's shapes, a BEiT's a relpos ViT's): checked on load.
        "backbone": bb.kind,
    }


def save_trainable(model: nn.Module, path: str | Path) -> None:
    """Write only the trained tensors, with the method and its config as metadata, to safetensors.

    The trained tensors are those :func:`apply` made trainable, also when the model was frozen since
    (``model.requires_grad_(False)`` after training), and any others that require grad (a norm unfrozen beside the
    method, which :func:`load_trainable` restores and makes trainable again).

    The metadata also holds a SHA-256 of the tensors (:func:`petl.model.params.content_hash`) and one of the rest of
    the metadata (:func:`metadata_hash`): safetensors itself has no checksum, and :func:`load_trainable` refuses a
    file whose tensors or metadata changed since it was written (an option edited that fits the tensors' shapes,
    LoRA's ``alpha`` say, would load and give other logits).

    Args:
        model: a model returned by :func:`apply`.
        path: the ``.safetensors`` file to write.

    """
    backbone_of(model)  # a wrapper (torch.compile's, DataParallel's) is named with the model to give instead
    if getattr(model, "petl_method", None) is None:
        raise ValueError("save_trainable needs a model prepared by petl.apply (no petl method found)")
    if any(getattr(m, "merged", False) for m in model.modules()):
        raise ValueError("unmerge the model before saving: merged weights are not trainable tensors")
    _check_not_meta(model, f"saving {path}")
    tensors = {n: t.cpu().contiguous() for n, t in trainable_state(model).items()}
    meta = {**_describe(model), "sha256": content_hash(tensors), FROZEN: frozen_fingerprint(model, set(tensors))}
    data = safetensors.torch.save(tensors, metadata={**meta, METADATA_HASH: metadata_hash(meta)})
    # Written by Python, not safetensors.save_file: a full disk then raises OSError(ENOSPC), which
    # callers can handle, instead of safetensors' own SafetensorError.  Whole or not at all: a crash mid-write
    # leaves the file that was there (an earlier save) as it was.
    write_atomic(Path(path), lambda tmp: tmp.write_bytes(data))


# The metadata field holding :func:`metadata_hash`; files of earlier petl versions have none (their tensors' hash is
# checked, their metadata is not).
METADATA_HASH = "metadata_sha256"
# The metadata field holding :func:`petl.model.params.frozen_fingerprint` of the backbone the tensors were trained on;
# files of earlier petl versions have none (they load onto any backbone of their shapes, as they did).
FROZEN = "frozen_fingerprint"


class OtherFrozenWeights(ValueError):
    """:func:`load_trainable` refuses a file trained on other frozen weights than the model's (its fingerprint).

    ``why`` says so without the remedy, which names ``load_trainable``'s own ``check_frozen``: a caller that takes no
    such argument (:class:`petl.MultiTask`) words its own.
    """

    def __init__(self, why: str, remedy: str) -> None:
        super().__init__(f"{why}: {remedy}")
        self.why = why


def metadata_hash(meta: dict[str, str]) -> str:
    """SHA-256 of a weights file's metadata, but this hash's own field: the method, its options, the backbone's shape
    and family, the format, the tensors' hash (so the tensors of another file with theirs do not pass either) and the
    frozen backbone's fingerprint.
    """
    described = {key: value for key, value in meta.items() if key != METADATA_HASH}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _check_not_meta(model: nn.Module, doing: str) -> None:
    """Refuse a model on the meta device: its tensors hold no values, and copying into them silently does nothing."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise ValueError(
            f"the model is on the meta device (its tensors hold no values), so {doing} would read or write nothing: "
            "materialise it first (model.to_empty(device='cpu'), then load its pretrained weights)"
        )


def _open_safetensors(path: str | Path) -> Any:
    """``safe_open`` whose errors name the file (safetensors' own messages do not)."""
    if Path(path).is_dir():  # not "no such file": the folder is there
        raise ValueError(f"{path} is a folder: give the .safetensors file in it (a run folder's is {WEIGHTS_FILE})")
    if not Path(path).is_file():
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
    try:
        return safe_open(str(path), framework="pt")
    except Exception as error:  # SafetensorError is not exported under a stable name
        raise ValueError(f"{path} is not a readable safetensors file ({error})") from None


def read_trainable_metadata(path: str | Path) -> dict[str, Any]:
    """The method, config and backbone shape recorded in a file written by :func:`save_trainable`.

    Raises:
        ValueError: not a safetensors file, not a petl file, a metadata field that is missing or
            malformed (the message names the file and the field), or metadata that do not match the hash
            :func:`save_trainable` recorded (:func:`metadata_hash`).

    """
    with _open_safetensors(path) as f:
        meta = f.metadata() or {}
    if meta.get("format") not in FORMATS:
        found = re.fullmatch(r"petl-trainable-(\d+)", str(meta.get("format")))
        if found is not None and int(found.group(1)) > len(FORMATS):
            newer = newer_file(Path(path), f"format {meta['format']}", FORMAT)
            raise ValueError(f"{newer}: upgrade petl to load it")
        raise ValueError(
            f"{path} is not a petl trainable-weights file (format {meta.get('format')!r}): give a file "
            "petl.save_trainable or petl-run wrote"
        )

    def field(key: str, parse: Callable[[str], Any]) -> Any:
        if key not in meta:
            raise ValueError(f"{path}: metadata field {key!r} is missing (the file was altered after saving)")
        try:
            if len(meta[key]) > MAX_METADATA_CHARS:
                raise ValueError(f"{len(meta[key])} characters, more than {MAX_METADATA_CHARS}")
            value = parse(meta[key])
            _check_bounded(value)
            return value
        except RecursionError:
            raise ValueError(f"{path}: metadata field {key!r} is malformed (nested too deeply)") from None
        except ValueError as error:  # JSONDecodeError is a ValueError
            raise ValueError(f"{path}: metadata field {key!r} is malformed ({error})") from None

    config = field("config", json.loads)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: metadata field 'config' is malformed (not a JSON object)")
    field("method", str)
    embed_dim, depth = field("embed_dim", int), field("depth", int)
    widths = field("widths", json.loads) if meta["format"] != FORMATS[0] else [embed_dim] * depth
    if not isinstance(widths, list) or len(widths) != depth or not all(isinstance(w, int) for w in widths):
        raise ValueError(f"{path}: metadata field 'widths' is malformed (not {depth} whole numbers)")
    # After the fields (one that cannot be right is named as such), before any caller compares them with a model or a
    # model.json: an edited option would be reported as the other side's mismatch, with the other side's remedy.
    if METADATA_HASH in meta and meta[METADATA_HASH] != metadata_hash(meta):
        raise ValueError(
            f"{path} is corrupt: its metadata (method, options, backbone) do not match the hash recorded when it was "
            "saved: restore the file as petl.save_trainable wrote it"
        )
    return {**meta, "config": config, "embed_dim": embed_dim, "depth": depth, "widths": widths}


# Bounds on what a weights file's metadata may claim, checked before anything is parsed further or built:
# real configs are flat (SCT's channel lists are the longest, a few thousand numbers) and small-valued.
MAX_METADATA_CHARS = 1 << 20
MAX_METADATA_DEPTH = 4
MAX_METADATA_INT = 1 << 31


def _check_bounded(value: Any, depth: int = 0) -> None:
    """Refuse metadata values nested deeper than configs are, or holding integers no option takes."""
    if depth > MAX_METADATA_DEPTH:
        raise ValueError(f"nested deeper than {MAX_METADATA_DEPTH} levels")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_METADATA_INT:
        raise ValueError(f"integer {value} out of range, at most {MAX_METADATA_INT} in size")
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        _check_bounded(child, depth + 1)


def _read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, checked against the hash in its metadata when it has one."""
    try:
        with _open_safetensors(path) as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (ValueError, FileNotFoundError):
        raise  # already name the file
    except Exception as error:  # a truncated file passes the header and fails on its tensors
        raise ValueError(f"{path} is not a readable safetensors file ({error})") from None
    recorded = meta.get("sha256")
    if recorded is None:
        warnings.warn(
            f"{path} has no content hash (written by an older petl): its tensors are not verified", stacklevel=3
        )
    elif content_hash(tensors) != recorded:
        raise ValueError(f"{path} is corrupt: its tensors do not match the content hash recorded when it was saved")
    return tensors


def read_header(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, safetensors dtype) of every tensor in a file, read from its header alone."""
    with _open_safetensors(path) as f:
        return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}


def _check_matches(
    path: str | Path, model: nn.Module, header: dict[str, tuple[tuple[int, ...], str]], needs: str = "the model needs"
) -> None:
    """Refuse (before anything is read or copied) a file whose names, shapes or dtypes do not fit ``model``.

    Besides the method's trained tensors the file may hold other tensors of the model: :func:`save_trainable` writes
    every tensor that requires grad, such as a norm the caller unfroze beside the method.
    """
    params = trainable_state(model)
    held = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    missing = sorted(params.keys() - header.keys())
    unexpected = sorted(header.keys() - params.keys() - held.keys())
    # Loaded, such a file would leave the model with a config that trains tensors the file never trained.
    earlier = trained_by_an_earlier_method(model, missing, unexpected)
    if earlier is not None:
        raise ValueError(f"{path} {earlier}; re-run the training to write it again")
    if missing or unexpected:
        raise ValueError(f"{path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    head_ids = {id(p) for p in backbone_of(model).head().parameters()}
    head = {n for n, p in model.named_parameters() if id(p) in head_ids}
    for name in sorted(header):
        (shape, dtype), param = header[name], params.get(name, held.get(name))
        if shape != tuple(param.shape):
            classes = backbone_of(model).num_classes()
            if name in head and param.shape[:1] == (classes,) and shape[1:] == tuple(param.shape[1:]):
                # Where the two differ in their class count alone, the remedy is the model's, not the file's.
                raise ValueError(
                    f"{path}: its head has {shape[0]} classes, this model's {classes}: load it onto a model of "
                    f"{shape[0]} classes (timm.create_model(..., num_classes={shape[0]}), or reset_classifier)"
                )
            raise ValueError(f"{path}: {name} has shape {shape}, {needs} {tuple(param.shape)}")
        # A float file loads onto a half-precision model (copy_ casts); integers never were weights.
        if dtype.startswith(("F", "BF")) != param.is_floating_point():
            raise ValueError(f"{path}: {name} has dtype {dtype}, {needs} {param.dtype}")


def load_trainable(model: nn.Module, path: str | Path, *, check_frozen: bool = True) -> nn.Module:
    """Restore trained tensors saved by :func:`save_trainable` onto ``model`` (in place).

    A fresh backbone (no petl method yet) first gets the method and config recorded in the file.  Tensors of the
    model the file holds beside the method's (a norm the caller unfroze and trained) are restored too, and train
    again as when saved.  Any mismatch of method, option, backbone family, depth, width or tensor shape raises a
    ValueError naming it, and so does a file whose tensors changed since it was saved, or that lacks tensors the
    method trains on this model (written by an earlier petl whose method trained fewer: Partial-k on a Swin before
    it trained the patch merging between trained blocks; re-run the training).  Everything is checked before
    anything is changed: on an error the model is exactly as it was (a fresh one gets no method applied).
    A model that :func:`petl.unload` merged this very file's tensors into is refused too (the update would count
    twice); a merged model that still holds its wrappers is told to unmerge first.
    Files are read with safetensors, so nothing is ever unpickled.

    The file records a fingerprint of the frozen backbone it was trained on (:func:`petl.model.params.
    frozen_fingerprint`: names, dtypes, shapes and a sample of the values): a backbone of the same shapes with other
    weights (another checkpoint, random init, or dtype) is refused, since the trained tensors would silently give
    other predictions on it.  The same checkpoint downloaded again loads.  Files written before petl recorded it
    hold no fingerprint and load onto any backbone of their shapes, as they did.

    Args:
        model: a fresh timm backbone, or one with the file's method and options applied.
        path: a ``.safetensors`` file written by :func:`save_trainable`.
        check_frozen: ``False`` loads onto other frozen weights of the same shapes anyway (moving an update trained
            on one checkpoint to a fine-tuned variant of it, knowingly).
    """
    bb = backbone_of(model)
    _check_not_meta(model, f"loading {path}")
    meta = read_trainable_metadata(path)
    for key, have in (("embed_dim", bb.widths()[0]), ("depth", bb.depth()), ("widths", bb.widths())):
        if have != meta[key]:
            raise ValueError(
                f"{path} was saved for a backbone with {key}={meta[key]}, this one has {key}={have}: load it onto the "
                "backbone it was trained on"
            )
    # Files saved before the family was recorded hold no "backbone": their shapes are all that is checked.
    if meta.get("backbone", bb.kind) != bb.kind:
        raise ValueError(
            f"{path} was saved for a backbone of kind {meta['backbone']!r}, this one is {bb.kind!r} "
            f"({type(model).__name__}): load it onto the backbone it was trained on"
        )
    fresh = getattr(model, "petl_method", None) is None
    if not fresh and model.petl_method != meta["method"]:
        raise ValueError(
            f"{path} holds method {meta['method']!r}, the model carries {model.petl_method!r}: load it onto a fresh "
            f"backbone (it applies {meta['method']!r} itself), or give a file of {model.petl_method!r}"
        )
    if not fresh:
        have = dataclasses.asdict(model.petl_config)
        for key, value in meta["config"].items():
            if key == "num_classes" and value is None:
                continue
            if json.loads(json.dumps(have.get(key))) != value:
                raise ValueError(
                    f"{path} was saved with {key}={value!r}, the model has {key}={have.get(key)!r}: load it onto a "
                    "fresh backbone (it applies the options it was saved with)"
                )
    if any(getattr(m, "merged", False) for m in model.modules()):
        raise ValueError(
            "unmerge the model before loading trainable weights (petl.unmerge(model)): its update is in its weights"
        )
    # The file's own tensor shapes are checked first, against the method built on a meta-device copy of a fresh
    # model: a config claiming a huge size (rank=2**30) allocates nothing, and a mismatch leaves the model as it was.
    header = read_header(path)
    trial = _applied(path, meta_copy(model), meta) if fresh else model  # the method's tensors, their names
    _check_matches(path, trial, header, "the config recorded in it needs" if fresh else "the model needs")
    tensors = _read_tensors(path)
    # petl.unload leaves the hash of the tensors it folded into the weights: this file's update is in them already.
    if (meta.get("sha256") or content_hash(tensors)) in getattr(model, "petl_merged", ()):
        raise ValueError(
            f"{path} is merged into this model already (petl.unload folded its update into the weights), so loading "
            "it would add the update twice: load it onto a fresh backbone (timm.create_model) instead"
        )
    recorded = meta.get(FROZEN)
    if check_frozen and recorded is not None:
        fingerprint = frozen_fingerprint(trial, set(header), values_of=model if fresh else None)
        if fingerprint != recorded:
            raise OtherFrozenWeights(
                f"{path} was trained on other frozen weights than this model's (another checkpoint, random init or "
                "dtype)",
                "load it onto the backbone it was trained on, in the dtype it was saved in (cast after loading), or "
                "pass check_frozen=False to load it onto these weights anyway",
            )
    if fresh:
        _applied(path, model, meta)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    besides = tensors.keys() - trainable_state(model).keys()  # trained beside the method (an unfrozen norm)
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
    for name in besides:  # trainable again, as when saved: training on and saving keep them
        if isinstance(params[name], nn.Parameter):
            params[name].requires_grad_(True)
    return model


def _applied(path: str | Path, model: nn.Module, meta: dict[str, Any]) -> nn.Module:
    try:
        return apply(model, meta["method"], **meta["config"])
    except (ValueError, TypeError) as error:  # TypeError: an option this petl version does not know
        raise ValueError(f"{path}: cannot apply its method {meta['method']!r}: {error}") from None
