"""Routing one mixed batch through a shared frozen backbone: each task's hooks act on its own rows only.

:class:`RoutedModule` and :class:`RoutedBlock` stand in for the backbone's modules that some task wraps or trains;
:func:`task_sites` finds, for one task's model, the hook at each such place (:mod:`petl.model.rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from timm.layers import LayerScale
from torch import nn

from petl.model.backbone import backbone_of, block_family
from petl.model.rows import CannotShare, RowHook, Tokens, registered_hook

Tensor = torch.Tensor


def _own_parameter_hook(module: nn.Module, frozen: nn.Module, path: str, own: list[str]) -> RowHook:
    """The hook of a backbone module some of whose parameters the task trained itself (BitFit, LN tuning).

    A trained LayerNorm or layer scale is cheap (no matmul): the task's rows go through its own module.  A Linear or
    Conv2d may have its own bias (added as a delta on the shared output); a trained weight matrix would need
    its own matmul per task, which is exactly what cannot be shared.
    """
    where = f"{path}.{own[0]}" if path else own[0]
    if isinstance(module, (nn.LayerNorm, LayerScale)):
        return RowHook(frozen, post=lambda x, y, _tokens: module(x))
    if isinstance(module, (nn.Linear, nn.Conv2d)) and own == ["bias"] and frozen.bias is not None:
        shape = (-1, 1, 1) if isinstance(module, nn.Conv2d) else (-1,)
        return RowHook(frozen, post=lambda x, y, _tokens: y + (module.bias - frozen.bias).view(shape))
    raise CannotShare(f"it trains {where}, a frozen weight every row's computation shares; serve it as its own model")


def _around(wrapper: RowHook, inner: RowHook) -> RowHook:
    """A wrapper's hook over a wrapped module that has its own parameters: ``inner.post`` first, then the wrapper's."""
    if wrapper.post is None:
        return replace(wrapper, post=inner.post)
    outer = wrapper.post
    return replace(wrapper, post=lambda x, y, tokens: outer(x, inner.post(x, y, tokens), tokens))


@dataclass
class Batch:
    """The current forward's rows: (task index, first row, end row) per task present, and the token layout."""

    groups: list[tuple[int, int, int]]
    tokens: Tokens


class Router:
    """Holds the batch being served, for every routed module of one :class:`MultiTask` (set only inside forward)."""

    batch: Batch | None = None

    def current(self) -> Batch:
        if self.batch is None:
            raise RuntimeError("a MultiTask's routed backbone runs only inside MultiTask.forward")
        return self.batch


def _each_task(
    batch: Batch, hooks: dict[int, RowHook], x: Tensor, act: Callable[[RowHook, slice], Any], own: bool = False
) -> Tensor:
    """``x`` with each task's rows replaced by ``act(hook, rows)``, where the task has a hook that acts (not None).

    ``own``: ``x`` is a fresh result of the calling module that nothing else holds, so without autograd the rows
    are written into it in place; otherwise (an input, which the caller still uses) the result is a new tensor.
    Copying the whole batch at every routed module would cost about as much as a small backbone's matmuls.
    """
    in_place = own and not torch.is_grad_enabled()
    parts, acted = [], False
    for task, start, end in batch.groups:
        hook = hooks.get(task)
        out = None if hook is None else act(hook, slice(start, end))
        if out is None:
            parts.append(x[start:end])
            continue
        if end - start == x.shape[0]:  # one task's batch
            return out
        acted = True
        if in_place:
            x[start:end] = out
        parts.append(out)
    return torch.cat(parts) if acted and not in_place else x


def _is_fresh(y: Tensor, x: Tensor) -> bool:
    """Whether a module's output ``y`` is a new tensor rather than (a view of) its input ``x`` (nn.Identity's)."""
    return y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


class RoutedModule(nn.Module):
    """A frozen module run once for the whole batch, with each task's pre/post hook on its own rows.

    Args:
        base: the frozen module (shared by every task).
        hooks: task index -> that task's hook here.
        router: the owning MultiTask's router (where the current batch is found).

    """

    def __init__(self, base: nn.Module, hooks: dict[int, RowHook], router: Router) -> None:
        super().__init__()
        self.base = base
        self.hooks, self._router = hooks, router
        for task, hook in hooks.items():
            if hook.mid or hook.branch or hook.visible is not None:
                raise CannotShare(f"task {task}: a hook inside a block's halves belongs on a block, not here")

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        batch = self._router.current()
        x = _each_task(batch, self.hooks, x, lambda h, rows: h.pre and h.pre(x[rows], batch.tokens))
        y = self.base(x, *args, **kwargs)
        post = lambda h, rows: h.post and h.post(x[rows], y[rows], batch.tokens)  # noqa: E731
        return _each_task(batch, self.hooks, y, post, own=_is_fresh(y, x))


class RoutedBlock(RoutedModule):
    """A frozen transformer block run once for the whole batch; tasks hook before it, between its halves, after it.

    With a ``mid``, ``branch`` or ``post`` hook the block runs as its two residual halves (timm's pre-norm
    ``Block``), so that ``mid`` can act on the stream between them, ``branch`` on the MLP's branch before its
    residual sum, and ``post`` can read the stream entering the MLP half.
    """

    def __init__(self, base: nn.Module, hooks: dict[int, RowHook], router: Router) -> None:
        nn.Module.__init__(self)
        self.base = base
        self.hooks, self._router = hooks, router
        self.halves = any(h.mid or h.branch or h.post for h in hooks.values())
        self.branches = any(h.branch for h in hooks.values())
        if self.halves:
            try:
                self.family = block_family(base)
            except ValueError as error:
                raise CannotShare(str(error)) from None

    def forward(self, x: Tensor, **kwargs: Any) -> Tensor:
        batch = self._router.current()
        x = _each_task(batch, self.hooks, x, lambda h, rows: h.pre and h.pre(x[rows], batch.tokens))
        if not self.halves:
            return self.base(x, **kwargs)
        # Each half ends with a residual sum, a fresh tensor this block owns.
        x = self.family.attn_residual(self.base, x, **kwargs)
        x = _each_task(batch, self.hooks, x, lambda h, rows: h.mid and h.mid(x[rows], batch.tokens), own=True)
        if self.branches:
            h = self.family.mlp_branch(self.base, x)
            branch = lambda hook, rows: hook.branch and hook.branch(h[rows], batch.tokens)  # noqa: E731
            h = _each_task(batch, self.hooks, h, branch, own=_is_fresh(h, x))
            y = x + h
        else:
            y = self.family.mlp_residual(self.base, x)
        post = lambda h, rows: h.post and h.post(x[rows], y[rows], batch.tokens)  # noqa: E731
        return _each_task(batch, self.hooks, y, post, own=True)


def method_name(model: nn.Module) -> str:
    """The task's method for messages; the peft bridge's tuner type with it (``peft LOHA``)."""
    method = str(model.petl_method)
    peft_type = getattr(model.petl_config, "peft_type", None)
    return f"{method} {peft_type}" if peft_type else method


def task_sites(model: nn.Module, backbone: nn.Module) -> dict[str, RowHook]:
    """Backbone module path -> this task's hook there, for every module its method wraps or trains.

    Walks the task's model along the backbone's module tree: a registered wrapper gives its hook (and the
    walk goes on inside the module it wraps, at the same path); a backbone module holding parameters of its
    own (not the backbone's) gets :func:`_own_parameter_hook`; anything else the backbone does not have at
    that path, or has with another type, is a wrapper without a hook.  The head is the task's own.
    """
    frozen = dict(backbone.named_modules())
    head = backbone_of(model).head()
    sites: dict[str, RowHook] = {}

    def add(path: str, hook: RowHook) -> None:
        if path in sites:
            raise CannotShare(f"it modifies {path or 'the model'} twice, which no hook composes")
        sites[path] = hook

    def walk(module: nn.Module, path: str) -> None:
        if module is head:
            return
        hook = registered_hook(module)
        if hook is not None:
            add(path, hook)
            walk(hook.wrapped, path)
            return
        plain = frozen.get(path)
        if plain is None or type(plain) is not type(module):
            kind = f"{type(module).__module__}.{type(module).__qualname__}"
            raise CannotShare(f"its {kind} at {path or 'the root'} has no multi-task hook yet")
        own = [n for n, p in module.named_parameters(recurse=False) if p is not getattr(plain, n, None)]
        if own:
            hook = _own_parameter_hook(module, plain, path, own)
            wrapper = sites.get(path)
            if wrapper is not None and wrapper.wrapped is module:  # GPS: a wrapper over a layer with its own bias
                sites[path] = _around(wrapper, hook)
            else:
                add(path, hook)
        for name, child in module.named_children():
            walk(child, f"{path}.{name}" if path else name)

    walk(model, "")
    return sites
