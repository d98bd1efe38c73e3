"""The base classes of petl's wrappers: :class:`PetlModule` keeps the wrapped layer as ``base`` (peft's model), and
:class:`PetlHead` is a classifier a method installs in place of timm's.

Merging, saving and counting find wrappers by ``isinstance``, never by parameter-name substrings.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn


def check_module(model: Any) -> None:
    """Refuse in one line what is no torch model: a :func:`petl.load_run` answer (its ``model`` is one), or else.

    Raises:
        ValueError: ``model`` is no ``nn.Module``.

    """
    if isinstance(model, nn.Module):
        return
    if isinstance(getattr(model, "model", None), nn.Module):  # petl.merge(run) for petl.merge(run.model)
        raise ValueError(f"got a {type(model).__name__}, not the model it holds: give its .model (run.model)")
    raise ValueError(f"got a {type(model).__name__}, not a torch model: give the timm model (an nn.Module)")


def factory_kwargs(model: nn.Module) -> dict[str, Any]:
    """``device`` and ``dtype`` of ``model``'s first parameter, for building modules that live beside it."""
    first = next(model.parameters())
    return {"device": first.device, "dtype": first.dtype}


# The key of a wrapper's state-dict metadata (``state_dict()._metadata``) that says whether it was merged.
MERGED_KEY = "petl_merged"


def _record_merged(module: PetlModule, _state_dict: dict, _prefix: str, local_metadata: dict) -> None:
    """``state_dict``'s post-hook of every wrapper: record in its metadata whether it is merged."""
    local_metadata[MERGED_KEY] = module.merged


def check_merged_not_training(layer: nn.Module, base: nn.Module) -> None:
    """Refuse the forward of ``layer``, merged into ``base``, that would train it (see
    :meth:`PetlModule.check_not_training`; peft's merged layers take it too).

    Raises:
        ValueError: in train mode with autograd on, a tensor of ``layer`` beside ``base``'s requires grad.

    """
    if not (layer.training and torch.is_grad_enabled()):
        return
    frozen_base = {id(p) for p in base.parameters()}
    if any(p.requires_grad and id(p) not in frozen_base for p in layer.parameters()):
        raise ValueError(
            f"{type(layer).__name__} is merged, so its tensors would get no gradient in training: "
            "petl.unmerge(model) before training on (model.eval() or torch.no_grad() to run it merged)"
        )


def holds_child(state_dict: dict, prefix: str, child: str, module: nn.Module) -> bool:
    """Whether ``state_dict`` holds every parameter of ``module``, the child ``child`` of the module at ``prefix`` (a
    wrapper's base layer, whose weights a merge writes).

    Every one, not any: a method may train one of the base layer's own tensors (GPS its bias), so a state dict cut
    down to the trained tensors holds that one and not the weight the update was merged into.
    """
    names = [f"{prefix}{child}.{name}" for name, _ in module.named_parameters()]
    return bool(names) and all(name in state_dict for name in names)


class PetlModule(nn.Module):
    """Base class of every petl wrapper: keeps the wrapped module as ``base``.

    A wrapper that can fold its update into ``base`` implements :meth:`fold` and :meth:`unfold` (as peft's
    ``BaseTunerLayer`` subclasses write only the merge itself); :meth:`merge` and :meth:`unmerge` keep the
    ``merged`` state, so folding twice or unfolding an unmerged wrapper cannot happen.
    """

    # Where the prompt tokens this wrapper adds to the token sequence sit: "front" (right after the class and
    # register tokens), "end", or "beside" (next to a Swin's grid, petl.model.backbone.swin_prompts); "" when it
    # adds none.  timm's forward_intermediates strips them (petl.model.timm_api).
    prompt_place: ClassVar[str] = ""
    # Why this wrapper cannot run under timm's gradient checkpointing; "" when it can (petl.model.timm_api refuses
    # set_grad_checkpointing(True) with this reason).
    no_grad_checkpointing: ClassVar[str] = ""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self._merged = False
        # A state dict of a merged wrapper holds ``base``'s weights with the update in them: its metadata says so,
        # so that loading it marks the wrapper merged (and an unmerged one's, unmerged), never counting it twice.
        self.register_state_dict_post_hook(_record_merged)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, *args: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)
        # ``base``'s weights (loaded next, as a child) hold the update or not as the saved wrapper's did; a state dict
        # without them (cut down to the method's tensors, strict=False) leaves them, and the mark, as they are.
        if MERGED_KEY in local_metadata and holds_child(state_dict, prefix, "base", self.base):
            self._merged = bool(local_metadata[MERGED_KEY])

    @property
    def merged(self) -> bool:
        """Whether the update is folded into ``base`` (forward then costs what ``base`` costs)."""
        return self._merged

    @property
    def mergeable(self) -> bool:
        """Whether this wrapper can merge: it implements :meth:`fold`."""
        return type(self).fold is not PetlModule.fold

    @torch.no_grad()
    def merge(self) -> None:
        """Fold this wrapper's update into ``base`` once (a merged wrapper stays as it is)."""
        if not self.mergeable:
            raise NotImplementedError(f"{type(self).__name__} cannot merge")
        if not self._merged:
            self.fold()
            self._merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo :meth:`merge` (an unmerged wrapper stays as it is)."""
        if not self.mergeable:
            raise NotImplementedError(f"{type(self).__name__} cannot unmerge")
        if self._merged:
            self.unfold()
            self._merged = False

    def merged_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The forward of a merged wrapper: ``base``'s alone, its update being in the weights."""
        self.check_not_training()
        # The wrapper's own module call stands in for base's: merged, this layer costs what the plain layer
        # costs (one module call and base's forward).  Hooks registered on ``base`` itself are skipped while
        # merged; hooks on this wrapper (the model's module at that path) still run.
        return self.base.forward(x)

    def check_not_training(self) -> None:
        """Refuse a merged wrapper's forward that would train it: merged, its tensors get no gradient.

        Called by a merged wrapper's forward.  Training on a merged model would leave the method's tensors as they
        are while they still show as trainable; run in eval mode or without autograd, or with them frozen (the
        head alone training on the merged model), the forward goes on.

        Raises:
            ValueError: in train mode with autograd on, a tensor of this wrapper beside ``base``'s requires grad.

        """
        check_merged_not_training(self, self.base)

    def fold(self) -> None:
        """Add the update into ``base``'s weights (mergeable wrappers implement it)."""
        raise NotImplementedError

    def unfold(self) -> None:
        """Take the update out of ``base``'s weights again (mergeable wrappers implement it)."""
        raise NotImplementedError


class PetlHead(nn.Module):
    """Base class of a classifier a method installs in place of timm's Linear head (Mlp-k's MLP, HST's head).

    timm's ``reset_classifier(n)`` would put a plain Linear in its place and silently drop the method; on a
    model from :func:`apply` it calls :meth:`for_classes` instead (:mod:`petl.model.timm_api`).
    """

    def for_classes(self, num_classes: int) -> nn.Module:
        """A fresh head of this method for ``num_classes`` (>= 1) classes, as :func:`apply` would build it."""
        raise NotImplementedError
