"""Saving and loading trained weights: only the trained tensors, with the method and its config as metadata.

Files are safetensors (nothing is ever unpickled) and carry a SHA-256 of their tensors, which
:func:`load_trainable` checks: safetensors itself has no checksum.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import hashlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

from petl import vit
from petl.core import apply, trainable_state

FORMAT = "petl-trainable-1"


def _describe(model: nn.Module) -> dict[str, str]:
    config = model.petl_config
    return {
        "format": FORMAT,
        "method": model.petl_method,
        "config": json.dumps(dataclasses.asdict(config), sort_keys=True),
        "embed_dim": str(vit.embed_dim(model)),
        "depth": str(vit.depth(model)),
    }


def save_trainable(model: nn.Module, path: str | Path) -> None:
    """Write only the trained tensors, with the method and its config as metadata, to safetensors.

    The metadata also holds a SHA-256 of the tensors (:func:`_content_hash`): safetensors itself has
    no checksum, and :func:`load_trainable` refuses a file whose bytes changed since it was written.

    Args:
        model: a model returned by :func:`apply`.
        path: the ``.safetensors`` file to write.

    """
    if getattr(model, "petl_method", None) is None:
        raise ValueError("save_trainable needs a model prepared by petl.apply (no petl method found)")
    if any(getattr(m, "merged", False) for m in model.modules()):
        raise ValueError("unmerge the model before saving: merged weights are not trainable tensors")
    tensors = {n: t.cpu().contiguous() for n, t in trainable_state(model).items()}
    data = safetensors.torch.save(tensors, metadata={**_describe(model), "sha256": _content_hash(tensors)})
    # Written by Python, not safetensors.save_file: a full disk then raises OSError(ENOSPC), which
    # callers can handle, instead of safetensors' own SafetensorError.
    with open(path, "wb") as f:
        f.write(data)


def _content_hash(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors in name order: each one's name, dtype and shape, then its raw bytes."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        # A uint8 view gives the bytes of every dtype (numpy has no bfloat16).
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _open_safetensors(path: str | Path) -> Any:
    """``safe_open`` whose errors name the file (safetensors' own messages do not)."""
    if not Path(path).is_file():
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
    try:
        return safe_open(str(path), framework="pt")
    except Exception as error:  # SafetensorError is not exported under a stable name
        raise ValueError(f"{path} is not a readable safetensors file ({error})") from None


def read_trainable_metadata(path: str | Path) -> dict[str, Any]:
    """The method, config and backbone shape recorded in a file written by :func:`save_trainable`.

    Raises:
        ValueError: not a safetensors file, not a petl file, or a metadata field that is missing or
            malformed (the message names the file and the field).

    """
    with _open_safetensors(path) as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a petl trainable-weights file (format {meta.get('format')!r})")

    def field(key: str, parse: Callable[[str], Any]) -> Any:
        if key not in meta:
            raise ValueError(f"{path}: metadata field {key!r} is missing (the file was altered after saving)")
        try:
            return parse(meta[key])
        except ValueError as error:  # JSONDecodeError is a ValueError
            raise ValueError(f"{path}: metadata field {key!r} is malformed ({error})") from None

    config = field("config", json.loads)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: metadata field 'config' is malformed (not a JSON object)")
    field("method", str)
    return {**meta, "config": config, "embed_dim": field("embed_dim", int), "depth": field("depth", int)}


def _read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, checked against the hash in its metadata when it has one."""
    try:
        with _open_safetensors(path) as f:
            recorded = (f.metadata() or {}).get("sha256")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (ValueError, FileNotFoundError):
        raise  # already name the file
    except Exception as error:  # a truncated file passes the header and fails on its tensors
        raise ValueError(f"{path} is not a readable safetensors file ({error})") from None
    if recorded is None:
        warnings.warn(
            f"{path} has no content hash (written by an older petl): its tensors are not verified", stacklevel=3
        )
    elif _content_hash(tensors) != recorded:
        raise ValueError(f"{path} is corrupt: its tensors do not match the content hash recorded when it was saved")
    return tensors


def _check_matches(path: str | Path, model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse (before anything is copied) a file whose names, shapes or dtypes do not fit ``model``."""
    params = trainable_state(model)
    missing, unexpected = sorted(params.keys() - tensors.keys()), sorted(tensors.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"{path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name in sorted(tensors):
        tensor, param = tensors[name], params[name]
        if tensor.shape != param.shape:
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, the model needs {tuple(param.shape)}")
        # A float file loads onto a half-precision model (copy_ casts); integers never were weights.
        if tensor.is_floating_point() != param.is_floating_point():
            raise ValueError(f"{path}: {name} has dtype {tensor.dtype}, the model needs {param.dtype}")


def load_trainable(model: nn.Module, path: str | Path) -> nn.Module:
    """Restore trained tensors saved by :func:`save_trainable` onto ``model`` (in place).

    A fresh backbone (no petl method yet) first gets the method and config recorded in the file.
    Any mismatch of method, option, depth, width or tensor shape raises a ValueError naming it, and
    so does a file whose tensors changed since it was saved.  Everything is checked before anything
    is changed: on an error the model is exactly as it was (a fresh one gets no method applied).
    Files are read with safetensors, so nothing is ever unpickled.
    """
    meta = read_trainable_metadata(path)
    for key in ("embed_dim", "depth"):
        have = vit.embed_dim(model) if key == "embed_dim" else vit.depth(model)
        if have != meta[key]:
            raise ValueError(f"{path} was saved for a backbone with {key}={meta[key]}, this one has {key}={have}")
    fresh = getattr(model, "petl_method", None) is None
    if not fresh and model.petl_method != meta["method"]:
        raise ValueError(f"{path} holds method {meta['method']!r}, the model carries {model.petl_method!r}")
    if not fresh:
        have = dataclasses.asdict(model.petl_config)
        for key, value in meta["config"].items():
            if key == "num_classes" and value is None:
                continue
            if json.loads(json.dumps(have.get(key))) != value:
                raise ValueError(f"{path} was saved with {key}={value!r}, the model has {key}={have.get(key)!r}")
    if any(getattr(m, "merged", False) for m in model.modules()):
        raise ValueError("unmerge the model before loading trainable weights")
    tensors = _read_tensors(path)
    # A fresh model is checked through a copy carrying the method, so a mismatch leaves it untouched.
    target = _applied(path, copy.deepcopy(model), meta) if fresh else model
    _check_matches(path, target, tensors)
    if fresh:
        _applied(path, model, meta)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
    return model


def _applied(path: str | Path, model: nn.Module, meta: dict[str, Any]) -> nn.Module:
    try:
        return apply(model, meta["method"], **meta["config"])
    except (ValueError, TypeError) as error:  # TypeError: an option this petl version does not know
        raise ValueError(f"{path}: cannot apply its method {meta['method']!r}: {error}") from None
