"""Counting a model's parameters, and the trained tensors a method's weights file holds."""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

import torch
from torch import nn

from petl.model.backbone import backbone_of, family_of
from petl.model.merging import _FOREIGN_MERGEABLE
from petl.model.wrappers import PetlModule, check_module


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


def trained_by_an_earlier_method(model: nn.Module, missing: list[str], unexpected: list[str]) -> str | None:
    """Why a saved state lacks ``missing`` of ``model``'s trained tensors, when its method explains it; else None.

    A weights file or a run's checkpoint that lacks tensors the model's method trains on it, and holds nothing the
    model does not, was written by an earlier petl whose method trained fewer (Partial-k on a Swin before it trained
    the patch merging between trained blocks), or edited since.  The words follow the file's path; the caller adds
    what to do (re-run the training, or start the run over).
    """
    method = getattr(model, "petl_method", None)
    if not missing or unexpected or not set(missing) <= set(getattr(model, "petl_trained", ())):
        return None
    names = ", ".join(sorted(missing)[:3]) + (", ..." if len(missing) > 3 else "")
    return (
        f"lacks tensors that {method!r} trains on this model ({names}): it was written by an earlier petl whose "
        f"{method!r} trained fewer, or edited since"
    )


def content_hash(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors in name order: each one's name, dtype and shape, then its raw bytes."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        # A uint8 view gives the bytes of every dtype (numpy has no bfloat16).
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


# How many values of each frozen tensor :func:`frozen_fingerprint` reads: evenly spaced over the tensor, so that
# another checkpoint or random init (which changes every value) differs, at a cost that does not grow with the model.
FINGERPRINT_VALUES = 1024


def frozen_fingerprint(model: nn.Module, skip: set[str], values_of: nn.Module | None = None) -> str:
    """SHA-256 of the backbone's frozen tensors as timm names them: each one's name, dtype, shape and
    :data:`FINGERPRINT_VALUES` of its values, evenly spaced.

    The same on the plain backbone as on the model :func:`petl.apply` made of it: a wrapped layer's tensors are named
    as before it was wrapped (LoRA's ``qkv.base.weight`` is ``qkv.weight``), and tensors a method added, the head's
    (reset to its class count) and those named in ``skip`` (the trained ones) are left out.  A sample, not every
    value: hashing all of a ViT-B's 86M values takes over a second; an edit of a few values may pass unseen.

    Args:
        model: a model with a method applied, or a plain backbone.
        skip: names (as in ``model``) of the tensors to leave out: the trained ones, which a weights file replaces.
        values_of: the plain backbone whose values to read, where ``model`` is a method applied on a copy of it
            (on the meta device: :func:`petl.model.surgery.meta_copy`) that says only which tensors count.

    """
    source = values_of if values_of is not None else model
    head = {id(t) for t in [*backbone_of(model).head().parameters(), *backbone_of(model).head().buffers()]}
    skipped = {plain_name(model, name) for name in skip}
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    chosen = {}
    for name, tensor in tensors.items():
        plain = plain_name(model, name)
        if plain is not None and plain not in skipped and id(tensor) not in head:
            chosen[plain] = tensor
    if values_of is not None:
        held = {**dict(source.named_parameters()), **dict(source.named_buffers())}
        chosen = {name: held[name] for name in chosen if name in held}
    digest = hashlib.sha256()
    for name in sorted(chosen):
        tensor = chosen[name].detach()
        flat = tensor.reshape(-1)
        count = min(flat.numel(), FINGERPRINT_VALUES)
        # Integer positions, computed on the CPU: the same on every device.
        where = torch.arange(count, dtype=torch.long) * max(flat.numel() - 1, 0) // max(count - 1, 1)
        sample = flat[where.to(flat.device)].cpu().contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(sample.view(torch.uint8).numpy())
    return digest.hexdigest()


def plain_name(model: nn.Module, name: str) -> str | None:
    """A tensor's name in the plain backbone (a wrapper's ``base`` dropped), or ``None`` for a method's own tensor."""
    parts = name.split(".")
    module, plain = model, []
    for part in parts[:-1]:
        child = module._modules.get(part)
        if child is None:
            return None
        if _is_wrapper(module):
            if not _stands_for(module, child):
                return None  # the wrapper's own (LoRA's A and B)
        else:
            plain.append(part)
        module = child
    return None if _is_wrapper(module) else ".".join([*plain, parts[-1]])


def _is_wrapper(module: nn.Module) -> bool:
    return isinstance(module, PetlModule) or bool(_FOREIGN_MERGEABLE) and isinstance(module, tuple(_FOREIGN_MERGEABLE))


def _stands_for(wrapper: nn.Module, child: nn.Module) -> bool:
    """Whether ``child`` is (or holds) the layer ``wrapper`` wraps: petl's ``base``, peft's ``base_layer``."""
    base = wrapper.base if isinstance(wrapper, PetlModule) else wrapper.get_base_layer()
    return any(m is base for m in child.modules())
