"""Unloading: a merged petl model back to the plain timm model it came from (peft's ``merge_and_unload``).

Every mergeable wrapper folds its update into its ``base`` and is replaced by that ``base``; what is
left is the timm architecture with other weights, whose ``state_dict`` loads into
``timm.create_model(name, num_classes=...)``.  Methods that add modules which cannot fold (adapters
with a non-linearity, prompts, an MLP head) cannot give a plain model and are refused in one line,
before anything changes.  Methods that add no module at all (linear, partial, full, bitfit, ln) are
plain already: unloading only drops petl's marks.

A model that merged keeps one mark, ``petl_merged``: the SHA-256 of the trained tensors it folded in (what
:func:`petl.save_trainable` records for them), so that :func:`petl.load_trainable` refuses to add the same update
to its weights a second time.
"""

from __future__ import annotations

import torch
from torch import nn

from petl.model import timm_api
from petl.model.backbone import backbone_of
from petl.model.merging import _FOREIGN_MERGEABLE, merge_updates
from petl.model.params import content_hash, trainable_state
from petl.model.wrappers import PetlModule, check_module

# What to do with a model that does not unload, said to petl-export's users as to Python's.
USE_AS_IT_IS = "(use it as a petl model: petl-predict or petl-serve on its run folder, petl.load_run in Python)"


class NotUnloadable(ValueError):
    """A model :func:`unload` refuses, before anything changed: ``why`` names what does not fold into the backbone.

    Its message adds what to use instead (:data:`USE_AS_IT_IS`); petl-export says its own remedy with ``why``.
    """

    def __init__(self, method: str | None, why: str) -> None:
        self.method, self.why = method, why
        super().__init__(f"method {method!r} cannot be unloaded into a plain timm model: {why} {USE_AS_IT_IS}")


def _base_of(module: nn.Module) -> nn.Module | None:
    """The module a mergeable wrapper stands for (petl's ``base``, peft's ``get_base_layer()``), else None."""
    if isinstance(module, PetlModule):
        return module.base if module.mergeable else None
    if _FOREIGN_MERGEABLE and isinstance(module, tuple(_FOREIGN_MERGEABLE)):
        return module.get_base_layer()
    return None


def _check_unloadable(model: nn.Module) -> None:
    check_module(model)
    method = getattr(model, "petl_method", None)
    for name, module in model.named_modules():
        if isinstance(module, PetlModule) and not module.mergeable:
            raise NotUnloadable(method, f"its {type(module).__name__} at {name} does not fold into the backbone")
    bb = backbone_of(model)
    head, plain = bb.head(), bb.plain_head_types()
    # A mergeable wrapper on the head (peft's LoRA on a Swin's head.fc) folds away: check the Linear it stands for.
    while _base_of(head) is not None:
        head = _base_of(head)
    if type(head) not in plain:
        raise NotUnloadable(method, f"its head is a {type(head).__name__}, timm's is a {plain[0].__name__}")


@torch.no_grad()
def unload(model: nn.Module) -> nn.Module:
    """Merge every mergeable wrapper and replace it by its base module (in place): a plain timm model.

    Args:
        model: a model prepared by :func:`petl.apply` (trained, merged or not).

    Returns:
        The same model object, now without petl wrappers or marks (``petl_method``, ``petl_config``, ``petl_trained``)
        but one: ``petl_merged``, the SHA-256 of the trained tensors folded into its weights, by which
        :func:`petl.load_trainable` refuses to load that file onto it again (its update would count twice).
        Its ``requires_grad`` flags stay as the method set them (the head and what the method trained in the
        backbone, BitFit's biases say, train; the rest is frozen): ``model.requires_grad_(True)`` to train it whole.

    Raises:
        NotUnloadable: (a ValueError) the method adds modules that cannot fold into the backbone, or a layer refuses
            to merge its update (nothing is changed).

    """
    _check_unloadable(model)
    merged = None
    if any(_base_of(m) is not None for m in model.modules()):
        # The weights file of these tensors records the same hash (save_trainable): loading it onto the merged
        # model would apply its update on top of itself, silently.
        merged = content_hash(trainable_state(model))
        try:
            merge_updates(model, restorable=False)  # the wrappers, and what they would keep, go
        except ValueError as error:  # a layer that cannot hold its update (SSF's shift on a qkv without bias)
            raise NotUnloadable(getattr(model, "petl_method", None), str(error)) from None
    # Outermost first: a replaced wrapper's inner modules are gone with it.
    for name, module in list(model.named_modules()):
        base = _base_of(module)
        if base is None or not name:
            continue
        # A wrapper may wrap another (RepAdapter's two row adapters on one in_proj): down to the plain module.
        while _base_of(base) is not None:
            base = _base_of(base)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if getattr(parent, child, None) is module:
            setattr(parent, child, base)
    for mark in ("petl_method", "petl_config", "petl_trained"):
        if hasattr(model, mark):
            delattr(model, mark)
    timm_api.uninstall(model)
    if merged is not None:
        model.petl_merged = (*getattr(model, "petl_merged", ()), merged)
    return model
