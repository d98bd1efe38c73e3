"""Faults and bad input (issue 10): no silent loss, no half-loaded model, one clear line for every fault.

The trainable-weights files are checked in-process; the run folder's lock and the kills use real
``petl-run`` subprocesses and SIGKILL.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import petl
from petl.run import cli, default_config, lock, records, runner, train

TINY = [
    "data=mini/digits",
    "data.subset=64",
    "model=vit_fractal_tiny_patch4_32",
    "model.pretrained=false",
    "+model.kwargs.depth=1",
    "+model.kwargs.embed_dim=48",
    "train.epochs=2",
    "train.batch_size=32",
    "train.progress=false",
]


def tiny(out: Path, *overrides: str) -> dict:
    return train(default_config([*TINY, f"output_dir={out}", *overrides]))


# --- trainable-weights files (items 3, 4, 8) --------------------------------------------------------


def _saved(tiny_vit, tmp_path: Path, method: str = "lora", **options) -> Path:
    path = tmp_path / "w.safetensors"
    model = petl.apply(tiny_vit(seed=1), method, num_classes=4, **options)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)  # trained values differ from a fresh init
    petl.save_trainable(model, path)
    return path


def _rewrite(path: Path, tensors=None, metadata=None) -> None:
    """Rewrite a safetensors file with other tensors or metadata (what tampering or a bug would do)."""
    with safe_open(str(path), framework="pt") as f:
        old_meta, old = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(old if tensors is None else tensors, str(path), metadata=old_meta if metadata is None else metadata)


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_failed_load_leaves_a_carrying_model_exactly_as_it_was(tiny_vit, tmp_path):
    path = _saved(tiny_vit, tmp_path)
    tensors, meta = _read(path)
    last = sorted(tensors)[-1]
    tensors[last] = torch.zeros(3, 3)  # only the last tensor in copy order is wrong
    _rewrite(path, tensors=tensors, metadata={**meta, "sha256": petl.core._content_hash(tensors)})
    model = petl.apply(tiny_vit(), "lora", num_classes=4)
    before = _state(model)
    with pytest.raises(ValueError, match=rf"{last} has shape \(3, 3\)"):
        petl.load_trainable(model, path)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_failed_load_leaves_a_fresh_model_without_the_method(tiny_vit, tmp_path):
    path = _saved(tiny_vit, tmp_path)
    tensors, meta = _read(path)
    tensors.pop(sorted(tensors)[0])
    _rewrite(path, tensors=tensors, metadata={**meta, "sha256": petl.core._content_hash(tensors)})
    model = tiny_vit()
    before = _state(model)
    with pytest.raises(ValueError, match="does not match the model: missing"):
        petl.load_trainable(model, path)
    assert getattr(model, "petl_method", None) is None
    assert _state(model).keys() == before.keys() and all(torch.equal(before[k], v) for k, v in _state(model).items())
    assert all(p.requires_grad for p in model.parameters())  # not frozen either


def test_good_file_still_loads_onto_a_fresh_model(tiny_vit, tmp_path):
    path = _saved(tiny_vit, tmp_path, "adapter")
    model = petl.load_trainable(tiny_vit(), path)
    with safe_open(str(path), framework="pt") as f:
        assert all(torch.equal(dict(model.named_parameters())[k], f.get_tensor(k)) for k in f.keys())


def test_a_flipped_byte_is_refused_naming_the_file(tiny_vit, tmp_path):
    path = _saved(tiny_vit, tmp_path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes: safetensors itself cannot notice
    path.write_bytes(bytes(data))
    model = petl.apply(tiny_vit(), "lora", num_classes=4)
    before = _state(model)
    with pytest.raises(ValueError, match=rf"{path} is corrupt: its tensors do not match the content hash"):
        petl.load_trainable(model, path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_file_without_a_hash_loads_with_a_warning(tiny_vit, tmp_path):
    path = _saved(tiny_vit, tmp_path)
    with safe_open(str(path), framework="pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "sha256"}
    _rewrite(path, metadata=meta)
    with pytest.warns(UserWarning, match="has no content hash"):
        model = petl.load_trainable(tiny_vit(), path)
    assert model.petl_method == "lora"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (tmp_path / "hashed").mkdir()
        petl.load_trainable(tiny_vit(), _saved(tiny_vit, tmp_path / "hashed"))  # hashed files load silently


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("depth", None, r"metadata field 'depth' is missing"),
        ("config", "{not json", r"metadata field 'config' is malformed \(Expecting property name"),
        ("embed_dim", "wide", r"metadata field 'embed_dim' is malformed"),
        ("config", "[1, 2]", r"metadata field 'config' is malformed \(not a JSON object\)"),
    ],
)
def test_tampered_metadata_names_the_file_and_the_field(tiny_vit, tmp_path, field, value, message):
    path = _saved(tiny_vit, tmp_path)
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    meta.pop(field) if value is None else meta.update({field: value})
    _rewrite(path, metadata=meta)
    for read in (petl.read_trainable_metadata, lambda p: petl.load_trainable(tiny_vit(), p)):
        with pytest.raises(ValueError, match=rf"^{path}: {message}"):
            read(path)


@pytest.mark.parametrize("damage", ["truncate", "zero", "garbage"])
def test_a_corrupt_safetensors_file_is_named(tiny_vit, tmp_path, damage):
    path = _saved(tiny_vit, tmp_path)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) - 40], "zero": b"", "garbage": b"\x07" * 64}[damage])
    model = tiny_vit()
    with pytest.raises(ValueError, match=rf"^{path} is not a readable safetensors file"):
        petl.load_trainable(model, path)
    assert getattr(model, "petl_method", None) is None
