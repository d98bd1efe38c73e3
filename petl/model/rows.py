"""Row hooks: how a method's wrapper acts on its own task's rows when one frozen backbone serves a mixed batch.

A method registers a hook factory beside its wrapper class (:func:`register_row_hook`); :class:`petl.MultiTask`
(:mod:`petl.deploy.multitask`) finds them by ``isinstance``.  This module sits with the model code, below the
methods, so that a method file never imports the deploy layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Tensor = torch.Tensor


@dataclass(frozen=True)
class Tokens:
    """The token layout of the current batch: prompt slots sit right after the class/register tokens.

    Attributes:
        prefix: class plus register tokens.
        slots: prompt slots after them (0 when no row of the batch carries prompts).

    """

    prefix: int
    slots: int

    def without_slots(self, x: Tensor) -> Tensor:
        """``x`` (rows x tokens x width) without the prompt slots: the sequence a prompt-free model sees."""
        if not self.slots:
            return x
        return torch.cat([x[:, : self.prefix], x[:, self.prefix + self.slots :]], dim=1)

    def with_slots(self, x: Tensor) -> Tensor:
        """``x`` with zero-filled prompt slots put back after its prefix (the inverse of :meth:`without_slots`)."""
        if not self.slots:
            return x
        zeros = x.new_zeros(x.shape[0], self.slots, *x.shape[2:])
        return torch.cat([x[:, : self.prefix], zeros, x[:, self.prefix :]], dim=1)


@dataclass(frozen=True)
class RowHook:
    """What one task's wrapper does to that task's rows while the frozen module it wraps runs for the whole batch.

    Each callable gets one task's rows (a contiguous slice of the batch) and the batch's :class:`Tokens`, and
    may return ``None`` to leave the rows as they are (a side network only reading them, as LST's ladders).

    Attributes:
        wrapped: the frozen module the wrapper wraps (its ``base``); searched for further hooks, never run.
        pre: ``pre(x, tokens) -> x``: the rows' input, before the frozen module.
        post: ``post(x, y, tokens) -> y``: the rows' output ``y`` given their input ``x``.  At a block, ``x``
            is the stream entering the MLP half (after the attention residual) and ``y`` the block's output.
        mid: ``mid(x, tokens) -> x`` (blocks only): the stream between the attention and MLP halves.
        branch: ``branch(h, tokens) -> h`` (blocks only): the MLP half's branch ``h`` (after layer scale and
            drop path) before its residual sum, as an adapter after the MLP sees it (NOAH).
        prompts: prompt slots the task uses (VPT's prompts, HST's meta tokens, NOAH's tail), 0 for none.
        visible: (blocks only) how many of the task's slots this block's tokens attend; ``None``: all its
            ``prompts`` (a task whose prompt count changes from block to block, as NOAH's, says it per block).
        pool_prompts: whether the pooling sees the task's prompts (VPT's ``original`` pool) or not (``img_pool``).

    """

    wrapped: nn.Module
    pre: Callable[[Tensor, Tokens], Tensor] | None = None
    post: Callable[[Tensor, Tensor, Tokens], Tensor] | None = None
    mid: Callable[[Tensor, Tokens], Tensor] | None = None
    branch: Callable[[Tensor, Tokens], Tensor] | None = None
    prompts: int = 0
    visible: int | None = None
    pool_prompts: bool = True


class CannotShare(ValueError):
    """A task's model holds something the mixed batch cannot share (the message says what)."""


# (wrapper class, hook factory), found by isinstance; methods register theirs next to the wrapper.
_ROW_HOOKS: list[tuple[type, Callable[[Any], RowHook]]] = []


def register_row_hook(cls: type) -> Callable:
    """Decorator registering ``make(wrapper) -> RowHook`` for instances of ``cls`` (a method's wrapper class).

    ``make`` may raise :class:`CannotShare` for a configuration it cannot serve; the task is then refused.
    """

    def decorate(make: Callable[[Any], RowHook]) -> Callable[[Any], RowHook]:
        if not any(known is cls for known, _ in _ROW_HOOKS):
            _ROW_HOOKS.append((cls, make))
        return make

    return decorate


def registered_hook(module: nn.Module) -> RowHook | None:
    for cls, make in _ROW_HOOKS:
        if isinstance(module, cls):
            return make(module)
    return None
