"""timm's model methods keep their meaning on a model that carries a petl method.

People keep using a model from :func:`petl.apply` as a timm model: they change its head, checkpoint its gradients,
pull intermediate feature maps, build timm's optimizer.  timm's own methods know nothing of petl's modules, so
:func:`install` gives the model four of its own (instance attributes that stand in front of the class's;
``functools.partial`` objects, so that they deep-copy and pickle with the model):

* ``reset_classifier(n)``: a method's own head (a :class:`~petl.model.wrappers.PetlHead`: Mlp-k's MLP, HST's
  head) is rebuilt for ``n`` classes as :func:`petl.apply` builds it, instead of timm's plain Linear that would
  drop the method; ``n = 0`` (timm's "no classifier") is refused for such a head.  The recorded config follows the new
  class count, so :func:`petl.save_trainable` / :func:`petl.load_trainable` still round-trip.
* ``set_grad_checkpointing(True)``: refused in one line when a wrapper cannot run under it
  (:attr:`petl.PetlModule.no_grad_checkpointing`: the side networks), rather than failing in the backward.
* ``forward_intermediates``: prompt tokens (:attr:`petl.PetlModule.prompt_place`: VPT, NOAH) are left out of
  the intermediate feature maps, which then have the plain model's shapes; the final features are timm's.
* ``no_weight_decay()``: timm's names plus those petl's wrappers exempt (VPT's prompts), so that timm's optimizer
  factory exempts what petl's does.
* ``forward_head(x, pre_logits=True)``: what the method's own head computes before its last Linear (Mlp-k's hidden
  layers, HST's normed side-network features), as timm's own MLP heads return it, not the backbone's features.
* ``prune_intermediate_layers``: timm's, refused in one line before anything changes where the method's head
  cannot follow (``prune_head=True`` would remove a head of its own; HST's head reads every block; NOAH's last
  block removes its prompts).

``torch.jit.script`` of a model with petl wrappers is refused in one line (``__prepare_scriptable__``): they use
Python that TorchScript cannot compile; ``torch.jit.trace`` and ``torch.compile`` give the same logits.

Everything else is timm's own method, called on the model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from timm.models._features import feature_take_indices
from torch import nn

from petl.model.backbone import backbone_of
from petl.model.merging import _FOREIGN_MERGEABLE
from petl.model.wrappers import PetlHead, PetlModule, factory_kwargs


def reset_classifier(model: nn.Module, num_classes: int, global_pool: str | None = None) -> None:
    """The ``reset_classifier`` of timm, keeping the method's own head (rebuilt for ``num_classes``) where it has one.

    Args:
        model: a model from :func:`petl.apply`.
        num_classes: classes of the new head.
        global_pool: timm's pooling option, passed on.

    Raises:
        ValueError: ``num_classes=0`` on a method whose head is its own (it has no 0-class form).

    """
    bb = backbone_of(model)
    old = bb.head()
    method = getattr(model, "petl_method", None)
    if isinstance(old, PetlHead) and num_classes < 1:
        raise ValueError(
            f"reset_classifier({num_classes}): method {method!r} classifies with its own {type(old).__name__}, which "
            "cannot be removed; for features call forward_features or forward_head(x, pre_logits=True)"
        )
    type(model).reset_classifier(model, num_classes, global_pool)
    if isinstance(old, PetlHead):
        head = old.for_classes(num_classes)
        head.to(**factory_kwargs(model))
        head.train(old.training)
        bb.set_head(head)
    # The head trains for every method (as petl.apply leaves it), and the config records its classes.
    bb.head().requires_grad_(True)
    if dataclasses.is_dataclass(getattr(model, "petl_config", None)):
        model.petl_config = dataclasses.replace(model.petl_config, num_classes=num_classes)


def set_grad_checkpointing(model: nn.Module, enable: bool = True) -> None:
    """The ``set_grad_checkpointing`` of timm, refused in one line when a petl wrapper of the model cannot run under it.

    Raises:
        ValueError: ``enable`` on a model with a wrapper that names why it cannot be checkpointed.

    """
    if enable:
        reason = next((m.no_grad_checkpointing for m in _wrappers(model) if m.no_grad_checkpointing), "")
        if reason:
            method = getattr(model, "petl_method", None)
            raise ValueError(f"gradient checkpointing: method {method!r} cannot use it: {reason}; leave it off")
    type(model).set_grad_checkpointing(model, enable)


def forward_intermediates(
    model: nn.Module,
    x: torch.Tensor,
    indices: int | list[int] | None = None,
    return_prefix_tokens: bool = False,
    norm: bool = False,
    stop_early: bool = False,
    output_fmt: str = "NCHW",
    intermediates_only: bool = False,
    output_dict: bool = False,
    **kwargs: Any,
) -> Any:
    """The ``forward_intermediates`` of timm, with the method's prompt tokens left out of the intermediates.

    Takes and returns what timm's does (see its docstring): each intermediate holds the patch tokens only (NCHW
    maps of the plain model's shape, or NLC), with the class and register tokens beside them when
    ``return_prefix_tokens`` is set.  The final features are timm's (prompts included where the pooling sees
    them, as ``forward_features`` returns them).
    """
    places = {m.prompt_place for m in _wrappers(model) if m.prompt_place}
    timm_forward = type(model).forward_intermediates
    if not places:
        # By keyword, and the ViT-only options only where given: a Swin's forward_intermediates has neither
        # return_prefix_tokens nor output_dict, and takes its other arguments in another order.
        options = {"output_dict": True} if output_dict else {}
        if return_prefix_tokens:
            options["return_prefix_tokens"] = True
        return timm_forward(
            model,
            x,
            indices=indices,
            norm=norm,
            stop_early=stop_early,
            output_fmt=output_fmt,
            intermediates_only=intermediates_only,
            **options,
            **kwargs,
        )
    if "beside" in places:
        # Prompts beside a Swin's grid (VPT): its backbone takes each stage's grid; the ViT-only options go on as
        # keywords, which a Swin refuses as timm's own method does.
        vit_only = {"return_prefix_tokens": True} if return_prefix_tokens else {}
        vit_only |= {"output_dict": True} if output_dict else {}
        return backbone_of(model).prompted_intermediates(
            x, indices, norm, stop_early, output_fmt, intermediates_only, **vit_only, **kwargs
        )
    if output_fmt not in ("NCHW", "NLC"):
        raise ValueError(f"forward_intermediates: output_fmt={output_fmt!r}: choose NCHW or NLC")
    # Prefix tokens asked for only where there are some (timm's relpos ViT fails on the ask without them).
    prefixed = backbone_of(model).num_prefix_tokens() > 0
    final, found = timm_forward(model, x, indices, prefixed, norm, stop_early, "NLC", False, **kwargs)
    if prefixed:
        tokens, prefixes = [t for t, _ in found], [p for _, p in found]
    else:
        tokens, prefixes = found, None
    rows, cols = backbone_of(model).feature_grid(x)
    patches = rows * cols
    # The prompts sit in front of the patch tokens (VPT) or behind them (NOAH); the patch tokens keep their order.
    tokens = [t[:, t.shape[1] - patches :] if "front" in places else t[:, :patches] for t in tokens]
    if output_fmt == "NCHW":
        tokens = [t.reshape(t.shape[0], rows, cols, -1).permute(0, 3, 1, 2).contiguous() for t in tokens]
    if output_dict:
        out: dict[str, Any] = {"image_intermediates": tokens}
        if prefixes is not None and return_prefix_tokens:
            out["image_intermediates_prefix"] = prefixes
        if not intermediates_only:
            out["image_features"] = final
        return out
    if prefixes is not None and return_prefix_tokens:
        tokens = list(zip(tokens, prefixes, strict=True))
    return tokens if intermediates_only else (final, tokens)


def no_weight_decay(model: nn.Module) -> set[str]:
    """The ``no_weight_decay`` of timm, plus what petl's modules exempt (VPT's prompts), named from the model's root.

    timm's optimizer factory (``create_optimizer_v2``) reads it, so it exempts what petl's own optimizer
    (:func:`petl.train.engine.no_weight_decay_names`) exempts.
    """
    names = set(type(model).no_weight_decay(model))
    for prefix, module in model.named_modules():
        listed = getattr(module, "no_weight_decay", None)
        if prefix and isinstance(module, PetlModule) and callable(listed):
            names |= {f"{prefix}.{n}" for n in listed()}
    return names


def forward_head(model: nn.Module, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
    """The ``forward_head`` of timm; with ``pre_logits``, the method's own head's features before its last Linear.

    timm documents ``pre_logits`` as the features the classifier's last layer reads (its MLP heads return their
    hidden layers' output).  A petl head (:class:`~petl.model.wrappers.PetlHead`) takes ``pre_logits`` as timm's
    heads do.
    """
    head = backbone_of(model).head()
    if pre_logits and isinstance(head, PetlHead):
        return head(type(model).forward_head(model, x, pre_logits=True), pre_logits=True)
    return type(model).forward_head(model, x, pre_logits)


def prune_intermediate_layers(
    model: nn.Module, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
) -> list[int]:
    """The ``prune_intermediate_layers`` of timm, refused in one line where the method's head cannot follow.

    Raises:
        ValueError: ``prune_head`` on a method whose head is its own (``reset_classifier(0)`` refuses it), or
            blocks dropped under a head that reads every block (HST's) or that remove the prompts (NOAH's last
            block), or any pruning of a Swin whose prompts run beside its grid into the final norm (VPT's);
            nothing is changed.

    """
    bb = backbone_of(model)
    head, method = bb.head(), getattr(model, "petl_method", None)
    if prune_head and isinstance(head, PetlHead):
        raise ValueError(
            f"prune_intermediate_layers: method {method!r} classifies with its own {type(head).__name__}, which "
            "prune_head=True would remove: pass prune_head=False to keep it"
        )
    # timm counts the taps (a ViT's blocks, a Swin's stages); the blocks after the last kept tap are dropped.
    taps = bb.feature_taps()
    _, max_index = feature_take_indices(len(taps), indices)
    dropped = [m for block in list(bb.block_container())[taps[max_index] + 1 :] for m in block.modules()]
    # A block that removes the prompts after itself (NOAH's last, VPT's with pool=img_pool) cannot be dropped: the
    # kept blocks would pass the prompts on into the features.
    strips = any(isinstance(m, PetlModule) and m.prompt_place and getattr(m, "strip", 0) for m in dropped)
    # Prompts beside a Swin's grid run through every stage into the final norm, which pruning would drop.
    beside = any(m.prompt_place == "beside" for m in _wrappers(model)) and (dropped or prune_norm)
    reason = (
        getattr(head, "needs_every_block", "")
        or (strips and "its last block removes the prompt tokens")
        or (beside and "its prompts run beside the grid through every stage into the final norm")
    )
    if reason and (dropped or beside):
        raise ValueError(f"prune_intermediate_layers: method {method!r} cannot drop blocks: {reason}")
    return type(model).prune_intermediate_layers(model, indices, prune_norm, prune_head)


def refuse_script(model: nn.Module) -> nn.Module:
    """``torch.jit.script``'s hook (``__prepare_scriptable__``): a model with petl wrappers is refused in one line.

    Raises:
        TypeError: always; the model has a petl wrapper (TorchScript cannot compile their Python).

    """
    wrapper = type(_unscriptable(model)[0])
    raise TypeError(
        f"torch.jit.script: method {getattr(model, 'petl_method', None)!r} wraps modules in "
        f"{wrapper.__module__}.{wrapper.__name__}, which TorchScript cannot compile: use torch.jit.trace or "
        "torch.compile (same logits)"
    )


# The timm methods a petl model answers itself, by name.
OVERRIDES: dict[str, Callable[..., Any]] = {
    "reset_classifier": reset_classifier,
    "set_grad_checkpointing": set_grad_checkpointing,
    "forward_intermediates": forward_intermediates,
    "no_weight_decay": no_weight_decay,
    "forward_head": forward_head,
    "prune_intermediate_layers": prune_intermediate_layers,
}
# Hooks of torch's that a model with petl wrappers answers (torch.jit.script reads it from the instance).
HOOKS: dict[str, Callable[..., Any]] = {"__prepare_scriptable__": refuse_script}


def install(model: nn.Module) -> None:
    """Give ``model`` (just prepared by :func:`petl.apply`) the methods of :data:`OVERRIDES` that its class has.

    Raises:
        ValueError: gradient checkpointing is already on and the method cannot run under it.

    """
    for name, function in OVERRIDES.items():
        if hasattr(type(model), name):
            setattr(model, name, functools.partial(function, model))
    if _unscriptable(model):
        for name, function in HOOKS.items():
            setattr(model, name, functools.partial(function, model))
    if backbone_of(model).grad_checkpointing():  # on already: refused here if the method cannot run under it
        model.set_grad_checkpointing(True)


def uninstall(model: nn.Module) -> None:
    """Remove what :func:`install` added: the model answers with its class's methods again (a plain timm model)."""
    for name in [*OVERRIDES, *HOOKS]:
        if isinstance(model.__dict__.get(name), functools.partial):
            delattr(model, name)


def _wrappers(model: nn.Module) -> list[PetlModule]:
    return [m for m in model.modules() if isinstance(m, PetlModule)]


def _unscriptable(model: nn.Module) -> list[nn.Module]:
    """The modules TorchScript cannot compile: petl's wrappers and the foreign ones petl merges (peft's layers)."""
    foreign = tuple(_FOREIGN_MERGEABLE)
    return [m for m in model.modules() if isinstance(m, PetlModule) or (foreign and isinstance(m, foreign))]


def support(model: nn.Module) -> dict[str, str]:
    """What timm's model methods and torch's tools do on ``model`` (from :func:`petl.apply`), one short cell each.

    The registry-wide tests (tests/methods/test_timm_api.py,
    tests/training/test_train_options.py) check every cell's claim on
    every experiment against the plain timm model: a rebuilt or plain head at ``n`` classes, pre-logits that the
    last Linear turns into the logits, the same gradients or a refusal, intermediates of the plain model's shapes,
    timm's pruning or a refusal, bf16 logits within bf16 precision of fp32, compiled and traced logits equal to
    the eager ones, a merged plain timm model with the same logits that ONNX exports, or a refusal.
    """
    head = backbone_of(model).head()
    wrappers = _wrappers(model)
    refusal = next((m for m in wrappers if m.no_grad_checkpointing), None)
    prompts = any(m.prompt_place for m in wrappers)
    own_head = isinstance(head, PetlHead)
    stripper = next(
        (m for m in wrappers if (m.prompt_place and getattr(m, "strip", 0)) or m.prompt_place == "beside"), None
    )
    if getattr(head, "needs_every_block", "") or stripper:
        prune = f"refused (`{type(stripper or head).__name__}`)"
    else:
        prune = "`prune_head=False` only" if own_head else "timm's"
    unfolded = next((m for m in wrappers if not m.mergeable), head if own_head else None)
    return {
        "reset_classifier(n)": f"rebuilds `{type(head).__name__}`" if own_head else "timm's Linear",
        "forward_head(pre_logits)": "the head's hidden features" if own_head else "timm's",
        "set_grad_checkpointing": f"refused (`{type(refusal).__name__}`)" if refusal else "same gradients",
        "forward_intermediates": "prompts left out" if prompts else "timm's",
        "prune_intermediate_layers": prune,
        "autocast": "yes",
        "torch.compile": "same logits",
        "torchscript": "trace; script refused" if _unscriptable(model) else "trace, script",
        "export (merged)": f"refused (`{type(unfolded).__name__}`)" if unfolded else "timm folder, ONNX",
    }
