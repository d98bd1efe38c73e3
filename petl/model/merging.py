"""Folding every wrapper's update into the frozen weights of a model, and out again (all or nothing).

petl's wrappers are found by ``isinstance`` (:class:`petl.model.wrappers.PetlModule`); foreign wrapper types with
``merge()``/``unmerge()`` of their own (peft's tuner layers) register here.
"""

from __future__ import annotations

import torch
from torch import nn

from petl.model.wrappers import PetlModule, check_module

# Foreign wrapper types (e.g. peft's tuner layers) that have merge()/unmerge() of their own.
_FOREIGN_MERGEABLE: list[type] = []


def register_mergeable_type(cls: type) -> None:
    """Let :func:`merge` / :func:`unmerge` also call ``merge()`` / ``unmerge()`` on instances of ``cls``."""
    if cls not in _FOREIGN_MERGEABLE:
        _FOREIGN_MERGEABLE.append(cls)


def _mergeables(model: nn.Module, doing: str = "merge") -> list[nn.Module]:
    found = [m for m in model.modules() if isinstance(m, PetlModule) and m.mergeable]
    found += [m for m in model.modules() if _FOREIGN_MERGEABLE and isinstance(m, tuple(_FOREIGN_MERGEABLE))]
    if found:
        return found
    method = getattr(model, "petl_method", None)
    if method is not None:
        raise ValueError(f"nothing to {doing}: method {method!r} adds no mergeable layer")
    if getattr(model, "petl_merged", ()):  # "method None adds no mergeable layer" said nothing of where it went
        raise ValueError(
            f"nothing to {doing}: petl.unload folded this model's update into its weights and removed its layers, "
            "for good: to run without it, build the backbone again"
        )
    raise ValueError(f"nothing to {doing}: the model carries no petl method (petl.apply one first)")


# The attribute of a merged wrapper holding its :class:`_Kept` copy, which :func:`unmerge` puts back bit for bit.
_KEPT = "_petl_unmerged_tensors"


class _Kept:
    """A merged wrapper's tensors as they were before the merge (on the CPU), and whether nothing wrote them since.

    Each in-place write (a ``load_state_dict``, an optimizer step) moves a tensor's version counter on; the merge notes
    them.  A copy of the model (``copy.deepcopy``; ``torch.save`` and ``torch.load`` of it) starts its tensors'
    counters anew, so the copy of this record notes the copy's own counters where the original's were unwritten.
    """

    def __init__(self, before: list[torch.Tensor], module: nn.Module) -> None:
        self.before, self.tensors = before, _tensors(module)
        self.versions: list[int] | None = [t._version for t in self.tensors]  # None: written since

    def _unwritten(self) -> bool:
        return self.versions is not None and [t._version for t in self.tensors] == self.versions

    def unwritten(self, module: nn.Module) -> bool:
        """Whether ``module`` holds the very tensors the merge left (none replaced), nothing written into them since."""
        now = _tensors(module)
        same = len(now) == len(self.tensors) and all(a is b for a, b in zip(now, self.tensors, strict=True))
        return same and self._unwritten()

    def __getstate__(self) -> dict:
        return {"before": self.before, "tensors": self.tensors, "unwritten": self._unwritten()}

    def __setstate__(self, state: dict) -> None:
        self.before, self.tensors = state["before"], state["tensors"]  # the copy's own tensors (deepcopy's memo)
        self.versions = [t._version for t in self.tensors] if state["unwritten"] else None


@torch.no_grad()
def merge_updates(model: nn.Module, restorable: bool = True) -> nn.Module:
    """Fold every mergeable wrapper's update into its frozen base weight (in place); see :func:`petl.merge`.

    All or nothing: a wrapper that refuses (a non-finite update, a layer without the bias a shift needs)
    raises after the wrappers merged before it are unmerged again and their tensors, and its own, put back bit for
    bit, so the model is never half merged, nor changed at all.  For that it holds a CPU copy of the wrappers'
    tensors while it runs (their base layers': host memory up to the model's size, also for a model on a GPU); with
    ``restorable`` each wrapper keeps its copy until :func:`unmerge` puts it back.
    """
    check_module(model)
    done: list[tuple[nn.Module, list[torch.Tensor]]] = []  # each merged wrapper, with its tensors as they were
    names = {id(m): name for name, m in model.named_modules()}
    merging: tuple[nn.Module, list[torch.Tensor]] | None = None
    try:
        for module in _mergeables(model):
            if not getattr(module, "merged", False):
                # Unmerging subtracts the update again, which rounds: W + U - U is not W in the last bits, and a
                # refused merge left the frozen weights (and their hash in model.json) changed.  A CPU copy while
                # the loop runs puts them back exactly.
                merging = (module, [t.detach().to("cpu", copy=True) for t in _tensors(module)])
                try:
                    module.merge()
                except ValueError as error:  # the wrapper's reason, with where it is
                    raise ValueError(f"{names[id(module)]}: {error}") from None
                done.append(merging)
                merging = None
    except Exception:
        if merging is not None:  # it may have written part of its update before it refused (SSF: weight, then bias)
            if getattr(merging[0], "merged", False):
                merging[0].unmerge()
            _put_back(*merging)
        for module, kept in reversed(done):
            module.unmerge()  # the wrapper's own state (petl's merged mark, peft's merged adapters)
            _put_back(module, kept)
        raise
    for module, kept in done if restorable else ():
        setattr(module, _KEPT, _Kept(kept, module))
    return model


def _put_back(module: nn.Module, kept: list[torch.Tensor]) -> None:
    """Copy ``kept`` (:func:`_tensors` of ``module`` as they were) back into the wrapper's tensors."""
    for tensor, value in zip(_tensors(module), kept, strict=True):
        tensor.copy_(value)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of a wrapper (its base layer's with them), in one order."""
    return [*module.parameters(), *module.buffers()]


@torch.no_grad()
def unmerge(model: nn.Module) -> nn.Module:
    """Undo :func:`petl.merge` (in place): the wrappers run their update beside the frozen weights again.

    What comes back: after ``petl.merge(model)`` (``restorable=True``, the default) every tensor of the wrapped
    layers is put back bit for bit from the CPU copy the merge kept, so the frozen weights' hashes (a run card's
    ``frozen_sha256``, a weights file's fingerprint) are those of before the merge.  After
    ``petl.merge(model, restorable=False)``, or where the merged weights were written since (a state dict loaded onto
    the merged model), the update is subtracted again, as peft's ``unmerge_adapter`` does: the weights come back to
    float rounding only (``W + U - U`` is not ``W`` in the last bits; SSF divides its scale back out, which a zero
    scale cannot), and a file saved afterwards records those rounded weights.  A wrapper that is not merged stays as
    it is.
    """
    check_module(model)
    modules = _mergeables(model, "unmerge")
    restore = {}
    for module in modules:  # all checked before any is changed: wrappers may share tensors (one wraps another)
        kept = module.__dict__.pop(_KEPT, None)
        # The copy is the wrapper's tensors as they were only while nothing wrote them since the merge (a state dict
        # loaded onto the merged model): else the update is subtracted, as without a copy.
        if kept is not None and getattr(module, "merged", False) and kept.unwritten(module):
            restore[id(module)] = kept.before
    # Last merged first: a wrapper around another (RepAdapter's two on one in_proj) kept the tensors of before both
    # merges, and puts them back last.
    for module in reversed(modules):
        module.unmerge()
        if id(module) in restore:
            _put_back(module, restore[id(module)])
    return model
