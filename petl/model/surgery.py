"""Method surgery on a model: :func:`apply` a registered method, :func:`merge` it back into the base weights.

Above :mod:`petl.model.registry` (the method registry), :mod:`petl.model.merging` and :mod:`petl.model.timm_api`
(what a petl model keeps of timm's API), so that none of them needs to reach up for the others.
"""

from __future__ import annotations

import copy
import sys
import warnings
from typing import Any

import torch
from torch import nn

from petl.model import timm_api
from petl.model.backbone import backbone_of
from petl.model.merging import merge_updates
from petl.model.params import trainable_state
from petl.model.registry import (
    MethodConfig,
    foreign_converter,
    get_method,
    make_config,
    method_for_config,
    plain_numbers,
)
from petl.model.unloading import unload as unload_model
from petl.model.wrappers import check_module


def apply(
    model: nn.Module, method: str | MethodConfig | Any, config: MethodConfig | None = None, **options: Any
) -> nn.Module:
    """Inject a method into a timm model in place, freeze what it does not train, and return the model.

    The method is named (``apply(model, "lora", rank=4)``) or given by its config
    (``apply(model, LoraConfig(rank=4))``).  The classifier head is reset to ``num_classes``
    (when given) and trains for every method.  The model records a copy of the config (``model.petl_config``):
    changing or reusing the config object afterwards leaves the model as it was built.

    Args:
        model: a timm model of a registered backbone kind (:func:`petl.list_backbones`: ``beit``, ``eva``,
            ``naflexvit``, ``swin``, ``swinv2``, ``swinv2_cr``, ``vit``, ``vit_parallel``, ``vit_relpos``; which
            method runs on which: the table in docs/backbones.md).
        method: a name from :func:`list_methods`, a method's config object, or a registered foreign config
            (a ``peft.PeftConfig``, which goes through the ``peft`` bridge).
        config: a ready config for a named method; otherwise one is built from ``options``.
        **options: the method's config fields, e.g. ``rank=4``; NumPy's integers and reals (a sweep's
            ``np.arange``) are recorded as Python's, which the weights file's JSON metadata takes.

    Returns:
        The same model, modified.

    Raises:
        ValueError: unknown method or option, a value out of range, an unsupported model, a backbone the method
            does not declare (:attr:`MethodSpec.backbones`), a model that already carries a petl method or peft's
            tuners, or one with timm's gradient checkpointing on for a method that cannot run under it.  Nothing
            is changed when it raises.

    """
    foreign = foreign_converter(method)
    if foreign is not None:
        # e.g. apply(model, peft.LoraConfig(...), num_classes=10): converted, then applied as any petl config.
        others = sorted(set(options) - {"num_classes"})
        if config is not None or others:
            raise ValueError(
                f"with a {type(method).__name__}, pass only num_classes; got {', '.join(others) or 'config'}"
            )
        method, options = foreign(method, num_classes=options.get("num_classes")), {}
    if isinstance(method, MethodConfig):
        if config is not None:
            raise ValueError("pass the config once: apply(model, config) or apply(model, name, config)")
        method, config = method_for_config(method), method
    spec = get_method(method)
    if config is None:
        config = make_config(method, **options)
    elif options:
        raise ValueError("pass either a config or keyword options, not both")
    if not isinstance(config, spec.config_cls):
        hint = f": pass options as keywords, apply(model, {method!r}, **options)" if isinstance(config, dict) else ""
        raise ValueError(f"method {method!r} takes a {spec.config_cls.__name__}, got {type(config).__name__}{hint}")
    # Checked first: a wrapped model would otherwise fail the ViT check with a misleading message.
    if getattr(model, "petl_method", None) is not None:
        raise ValueError(f"this model already carries petl method {model.petl_method!r}; start from a fresh model")
    _check_no_peft(model)
    # A copy: the caller's config object may be changed or reused for another model afterwards, and the model's
    # recorded config (what save_trainable writes) must stay the one its modules were built from.
    config = copy.deepcopy(config)
    plain_numbers(config)  # NumPy numbers (a sweep's np.arange) as Python's, which the weights file's JSON writes
    check_supported(model, method)
    bb = backbone_of(model)
    config.validate(model)
    # The formula reads every part the method will touch: a Linear the family lacks (EVA-02's separate q/k/v, its
    # SwiGLU's two fc1) is refused here in one line, before anything changes.
    spec.trainable_formula(model, config)
    if bb.grad_checkpointing():
        # Whether the method runs under timm's checkpointing is known once its wrappers are built (install checks
        # it): built first on a meta-device copy, which allocates nothing, so that a refusal changes nothing here.
        trial = meta_copy(model)
        trial.set_grad_checkpointing(False)  # checked once, below, not again within this apply
        apply(trial, method, config).set_grad_checkpointing(True)
    model.requires_grad_(False)
    # Kept referenced, so that no new module can reuse the id of one dropped meanwhile (the old head).
    existing = {id(m): m for m in model.modules()}
    if config.num_classes is not None:
        bb.reset_head(config.num_classes)
    spec.inject(model, config)
    _follow_modes(model, existing)
    bb.head().requires_grad_(True)
    model.petl_method = method
    model.petl_config = config
    # What the method trains, by name: saved even if the caller freezes the model after training (trainable_state).
    model.petl_trained = tuple(trainable_state(model))
    timm_api.install(model)
    return model


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose tensors live on the meta device: building a method on it allocates nothing."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        shadow = torch.empty_like(tensor, device="meta")
        is_param = isinstance(tensor, nn.Parameter)
        memo[id(tensor)] = nn.Parameter(shadow, requires_grad=tensor.requires_grad) if is_param else shadow
    return copy.deepcopy(model, memo)


def _peft_classes() -> tuple[type, ...]:
    """The model and tuner base classes of peft, if it was imported; none otherwise (no module of peft's exists)."""
    tuners, models = sys.modules.get("peft.tuners.tuners_utils"), sys.modules.get("peft.peft_model")
    found = (
        getattr(tuners, "BaseTunerLayer", None),
        getattr(tuners, "BaseTuner", None),
        getattr(models, "PeftModel", None),
    )
    return tuple(cls for cls in found if cls is not None)


def _check_no_peft(model: nn.Module) -> None:
    """Refuse a model peft has already wrapped or injected into, whose wrapped layers petl's checks cannot read."""
    classes = _peft_classes()
    modules = model.named_modules() if classes and isinstance(model, nn.Module) else ()  # not a model: said later
    found = next(((name, m) for name, m in modules if isinstance(m, classes)), None)
    if found is not None:
        name, module = found
        where = (
            f"is a peft {type(module).__name__}" if not name else f"carries peft's {type(module).__name__} at {name}"
        )
        raise ValueError(
            f"this model {where}: petl.apply takes a plain timm model; start from a fresh one "
            "(petl.apply(model, peft_config) injects a peft config's tuners itself)"
        )


def _follow_modes(parent: nn.Module, existing: dict[int, nn.Module]) -> None:
    """Give every module a method added the mode of the module it wraps, else of the module it was added to.

    A new module starts in train mode: on a model in eval mode, an adapter's dropout would act at inference.
    """
    for child in parent.children():
        if id(child) not in existing:
            wrapped = next((m for m in child.modules() if id(m) in existing), None)
            child.training = (wrapped if wrapped is not None else parent).training
        _follow_modes(child, existing)


def check_supported(model: nn.Module, method: str) -> None:
    """Refuse a backbone the method does not declare (:func:`petl.register_method`'s ``backbones``), saying why.

    :func:`apply` checks it first; ``petl-run`` also checks it before a method's calibration, which would otherwise
    fail later on what the backbone lacks.

    Raises:
        ValueError: the model is no backbone petl reads, one without a pooling (``global_pool=''``), or one of a
            kind the method does not support.

    """
    spec = get_method(method)
    bb = backbone_of(model)
    bb.check()
    if bb.pool_type() == "":
        # timm's global_pool='' leaves the tokens unpooled: logits per token (a Swin's per grid cell), which the
        # training loss took for a batch of spatial targets and failed on at the first step.
        raise ValueError(
            f"{type(model).__name__} is built with global_pool='' (no pooling: its head gives logits per token), "
            "where petl trains one label per image: build it with a pooling (leave global_pool out for timm's)"
        )
    if bb.kind not in spec.backbones:
        why = f": {spec.why_refused(bb.kind)}" if spec.why_refused(bb.kind) else ""
        raise ValueError(
            f"method {method!r} does not support the {bb.kind} backbone ({type(model).__name__}): "
            f"it supports {', '.join(spec.backbones)}{why}"
        )


@torch.no_grad()
def merge(model: nn.Module, unload: bool | None = None, *, restorable: bool = True) -> nn.Module:
    """Fold every mergeable wrapper's update into its frozen base weight (in place); the wrappers stay.

    All or nothing: a wrapper that refuses (a non-finite update, a layer without the bias a shift needs)
    raises after the wrappers merged before it are unmerged again, their tensors (and the refusing one's) put back bit
    for bit, so the model is never half merged nor changed; for that it holds a CPU copy of the wrapped layers'
    tensors while it runs (host memory up to the model's size, on a GPU too), and keeps it (``restorable``) so that
    :func:`petl.unmerge` puts the weights back bit for bit; ``restorable=False`` frees it, and unmerge then subtracts
    the update again, the weights coming back to float rounding only.  :func:`petl.unload` merges and then
    removes the wrappers (a plain timm model), as peft's ``merge_and_unload()`` beside its ``merge_adapter()``.

    The model's ``state_dict()`` says which wrappers are merged (in torch's state-dict metadata, which ``torch.save``
    keeps; a copy into a plain dict drops it): ``load_state_dict`` onto a model of the same method and config marks
    its wrappers merged or unmerged as the saved ones were, so the update counts once either way (a wrapper whose
    base weights the state dict does not all hold, one cut down to the method's tensors, keeps its mark).  A merged
    wrapper's tensors get no gradient: a forward in train mode with autograd on while they require grad is refused
    (:func:`petl.unmerge` first to train on); in eval mode, without autograd, or with them frozen it runs.

    Args:
        model: a model prepared by :func:`petl.apply`.
        unload: deprecated: ``merge(model, unload=True)`` is ``petl.unload(model)``, and warns.
        restorable: keep a CPU copy of the wrapped layers' tensors (host memory up to the model's size) until
            :func:`petl.unmerge`, which puts them back bit for bit; ``False`` for a model that will not be unmerged.
    """
    check_module(model)  # said as it is, not as a layer that could not merge
    if unload is not None:
        # One operation per name, as peft's; the flag stays for a release so that earlier code still runs.
        warnings.warn(
            "petl.merge(model, unload=...) is deprecated: call petl.unload(model) to merge and remove the "
            "wrappers, petl.merge(model) to merge only",
            DeprecationWarning,
            stacklevel=3,  # torch.no_grad's wrapper stands between the caller and here
        )
        if unload:
            return unload_model(model)
    try:
        return merge_updates(model, restorable)
    except ValueError as error:  # a layer that cannot hold its update: say that nothing is lost by not merging
        if getattr(model, "petl_method", None) is None:  # no method to run as trained: the reason says what to do
            raise
        raise ValueError(f"{error}; the model is left unmerged, and runs as trained without merging") from None
