"""Counting a model's parameters, and the trained tensors a method's weights file holds."""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

import torch
from torch import nn

from petl.model.backbone import family_of
from petl.model.wrappers import check_module


class ParamCount(NamedTuple):
    """Parameter counts of a model."""

    trainable: int
    trainable_no_head: int
    total: int


def count_params(model: nn.Module) -> ParamCount:
    """Count trainable parameters (with and without the classifier head) and all parameters.

    The head is the one petl's backbone family names, or for another timm model its ``get_classifier()``; a model
    with neither has no head to leave out.  A model inside ``DataParallel`` or ``torch.compile`` is counted as itself.
    """
    check_module(model)
    # The same parameters; a wrapper has no head of its own to leave out.  Unwrapped whatever the nesting: a compiled
    # DataParallel's head is found through neither wrapper (torch.compile's getattr reaches DataParallel, headless).
    while True:
        if isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            break
    family = family_of(model)
    if family is not None:
        head = family(model).head()
    else:  # any timm model (a ResNet's head is its fc, which no "head" attribute names)
        classifier = getattr(model, "get_classifier", None)
        head = classifier() if callable(classifier) else None
    head_ids = {id(p) for p in head.parameters()} if isinstance(head, nn.Module) else set()
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ParamCount(
        trainable=sum(p.numel() for p in trainable),
        trainable_no_head=sum(p.numel() for p in trainable if id(p) not in head_ids),
        total=sum(p.numel() for p in model.parameters()),
    )


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trained tensors by name (what :func:`save_trainable` writes).

    Besides the parameters that require grad, the buffers of modules whose own parameters all
    train: the running statistics of a trained BatchNorm (Mlp-k's head) are learnt state too.  The
    tensors :func:`petl.apply` made trainable stay in it when frozen since (``model.requires_grad_(False)``
    after training), so that the file :func:`save_trainable` writes still holds the method's tensors.
    """
    state = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    for prefix, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and all(p.requires_grad for p in own):
            for name, buffer in module.named_buffers(recurse=False):
                state[f"{prefix}.{name}" if prefix else name] = buffer.detach()
    recorded = getattr(model, "petl_trained", ())
    if recorded:
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        state.update({n: tensors[n].detach() for n in recorded if n in tensors})
    return state


def content_hash(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors in name order: each one's name, dtype and shape, then its raw bytes."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        # A uint8 view gives the bytes of every dtype (numpy has no bfloat16).
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
