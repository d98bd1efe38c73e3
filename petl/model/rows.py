"""Row hooks: how a method's wrapper acts on its own task's rows when one frozen backbone serves a mixed batch.

A method registers a hook factory beside its wrapper class (:func:`register_row_hook`); :class:`petl.MultiTask`
(:mod:`petl.deploy.multitask`) finds them by ``isinstance``.  This module sits with the model code, below the
methods, so that a method file never imports the deploy layer.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
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
class Batched:
    """A hook's batched form: one op over every row of the mixed batch, each row with its own task's tensors.

    Serving many adapters the way Punica (BGMV), S-LoRA and vLLM do: the frozen layer once, then one batched per-row
    update, not a loop over tasks.  The tensors of every task whose hook at a module has the same ``key`` (and
    tensor shapes, but for ``pad``) are stacked once, when :class:`petl.MultiTask` is built, with one more entry,
    ``neutral``, for the rows of the batch's other tasks; a batch then gathers each row's entry of every tensor (one
    gather per dtype, whatever the number of tensors) and hands them to ``post`` or ``pre``.

    Attributes:
        key: hooks at one module stack when their keys (and the shapes and dtypes of their tensors) are equal;
            ``post`` itself is part of it, plus whatever else ``post`` needs to be the same (an activation).
        tensors: this task's tensors, computed once (inference only: a task's tensors do not change).
        neutral: tensors of the same shapes with which ``post`` leaves a row as it is (zeros for an additive
            update, a scale of one); they must give exactly the row back.
        post: ``post(x, y, rows) -> y`` over the whole batch, as :attr:`RowHook.post` over one task's rows:
            ``rows`` holds each of ``tensors`` as every row's own (rows first: row ``i`` has its task's tensor at
            ``rows[k][i]``, the neutral one for a row of another task), a vector (one value per channel) as rows x 1
            x channels, the shape that broadcasts over tokens (:func:`rows_vector` shapes it for other layouts).
        pre: ``pre(x, tokens, rows) -> x``: the same for :attr:`RowHook.pre` (a form has one of the two).
        post_in_place: ``post_in_place(x, y, rows)``: what ``post`` does, done on ``y`` itself, in as many ops.  A
            stack acting on some of the batch's rows (the span of its tasks' rows) writes them into the frozen
            module's fresh output with it where no autograd records; without it, ``post``'s result is copied in.
        pad: per tensor, a dimension along which zeros are neutral (a low-rank update's rank: a zero row of A and
            column of B add nothing), or ``None``: tasks whose tensors differ in size there stack, each padded with
            zeros to the largest (S-LoRA serves adapters of many ranks in one batch).
        reads_input: whether ``post`` and ``post_in_place`` read ``x``; where not (a scale and shift of ``y``),
            they get ``None`` for it: slicing ``x``'s rows is a view op the host dispatches at every call.

    """

    key: Hashable
    tensors: tuple[Tensor, ...]
    neutral: tuple[Tensor, ...]
    post: Callable[[Tensor | None, Tensor, tuple[Tensor, ...]], Tensor] | None = None
    pre: Callable[[Tensor, Tokens, tuple[Tensor, ...]], Tensor] | None = None
    pad: tuple[int | None, ...] = ()
    post_in_place: Callable[[Tensor | None, Tensor, tuple[Tensor, ...]], None] | None = None
    reads_input: bool = True


def rows_matmul(x: Tensor, weight: Tensor, add: Tensor | None = None) -> Tensor:
    """``x`` (rows x ... x in) times the transpose of each row's own ``weight`` (rows x out x in), plus ``add``.

    One batched matmul (``bmm``, or ``baddbmm`` adding into ``add``, of ``x``'s rows x ... x out shape), as Punica's
    BGMV: each row's weight is gathered by the caller (a :class:`Batched` form's ``rows``).  A 3-d ``x`` (rows x
    tokens x in) and ``add`` go to it as they are: a reshape of them and a view of the result are ops the host
    dispatches.
    """
    flat = x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])
    if add is None:
        out = torch.bmm(flat, weight.transpose(1, 2))
    else:
        add = add if add.dim() == 3 else add.reshape(x.shape[0], -1, weight.shape[1])
        out = torch.baddbmm(add, flat, weight.transpose(1, 2))
    return out if x.dim() == 3 else out.view(*x.shape[:-1], weight.shape[1])


def _in_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``, cast only where it differs: a served forward counts its ops."""
    return t if t.dtype == dtype else t.to(dtype)


def rows_matmul_(y: Tensor, x: Tensor, weight: Tensor) -> None:
    """``y += x`` times the transpose of each row's own ``weight``, in place: one ``baddbmm_`` into ``y`` where it is
    contiguous (a Linear's output, or a slice of its rows), else a ``bmm`` and an add.  3-d tensors go to it as they
    are (:func:`rows_matmul`).

    In ``y``'s dtype: autocast leaves in-place ops alone, and under it ``y`` (a Linear's output) is bf16 while the
    task's ``weight`` stays fp32, which ``baddbmm_`` refuses; the out-of-place form would compute in bf16 there too.
    """
    flat = x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])
    flat, weight = _in_dtype(flat, y.dtype), _in_dtype(weight, y.dtype)
    if y.is_contiguous():
        out = y if y.dim() == 3 else y.view(y.shape[0], -1, weight.shape[1])
        out.baddbmm_(flat, weight.transpose(1, 2))
    else:
        y.add_(torch.bmm(flat, weight.transpose(1, 2)).view(y.shape))


def rows_vector(vector: Tensor, like: Tensor, channel_dim: int = -1) -> Tensor:
    """Each row's own vector (rows x channels, or rows x 1 x channels as a :class:`Batched` form gets it), shaped to
    broadcast over ``like`` (rows first, channels at ``channel_dim``: -1, or 1 for NCHW).
    """
    if channel_dim == -1 and like.dim() == 3:  # tokens: the common case, without building a shape
        # A stack's gathered vectors come in this shape already: a view here is an op the host dispatches.
        return vector if vector.dim() == 3 else vector.unsqueeze(1)
    shape = [vector.shape[0]] + [1] * (like.dim() - 1)
    shape[channel_dim] = vector.shape[-1]
    return vector.view(shape)


def _affine_channels_last(x: Tensor | None, y: Tensor, rows: tuple[Tensor, ...]) -> Tensor:
    scale, shift = rows
    return torch.addcmul(rows_vector(shift, y), y, rows_vector(scale, y))


def _affine_channels_first(x: Tensor | None, y: Tensor, rows: tuple[Tensor, ...]) -> Tensor:
    scale, shift = rows
    return torch.addcmul(rows_vector(shift, y, 1), y, rows_vector(scale, y, 1))


def _affine_channels_last_(x: Tensor | None, y: Tensor, rows: tuple[Tensor, ...]) -> None:
    scale, shift = rows
    torch.addcmul(rows_vector(shift, y), y, rows_vector(scale, y), out=y)  # one op, written over y itself


def _affine_channels_first_(x: Tensor | None, y: Tensor, rows: tuple[Tensor, ...]) -> None:
    scale, shift = rows
    torch.addcmul(rows_vector(shift, y, 1), y, rows_vector(scale, y, 1), out=y)


def affine(scale: Tensor, shift: Tensor, channel_dim: int = -1) -> Batched:
    """The batched form of ``y * scale + shift`` per channel (SSF; a trained bias's delta with a scale of one).

    Args:
        scale: one value per channel.
        shift: one value per channel.
        channel_dim: where ``y``'s channels are: -1, or 1 for a convolution's NCHW output.

    """
    post = _affine_channels_first if channel_dim == 1 else _affine_channels_last
    in_place = _affine_channels_first_ if channel_dim == 1 else _affine_channels_last_
    neutral = (torch.ones_like(scale), torch.zeros_like(shift))
    tensors = (scale.detach(), shift.detach())
    return Batched(post, tensors, neutral, post=post, post_in_place=in_place, reads_input=False)


def _low_rank_update(x: Tensor, y: Tensor, rows: tuple[Tensor, ...]) -> Tensor:
    """Every row's own update added to the frozen output: each row's A and B (gathered), two bmm (BGMV)."""
    a, b = rows
    return rows_matmul(rows_matmul(x, a), b, add=y)


def _low_rank_update_(x: Tensor, y: Tensor, rows: tuple[Tensor, ...]) -> None:
    """:func:`_low_rank_update` added into ``y`` itself: a ``bmm`` and a ``baddbmm_``."""
    a, b = rows
    rows_matmul_(y, rows_matmul(x, a), b)


def low_rank(a: Tensor, b: Tensor) -> Batched:
    """The batched form of ``y + x A^T B^T`` (LoRA's update; FacT's, its factors multiplied out), the scale in ``B``.

    Updates stack whichever method made them and whatever their rank (zero-padded to the largest), as S-LoRA serves
    adapters of many kinds and ranks.
    """
    a, b = a.detach(), b.detach()
    neutral = (torch.zeros_like(a), torch.zeros_like(b))
    return Batched(
        _low_rank_update, (a, b), neutral, post=_low_rank_update, pad=(0, 1), post_in_place=_low_rank_update_
    )


def add_matmul_(y: Tensor, z: Tensor, weight_t: Tensor, alpha: float = 1.0) -> None:
    """``y += alpha * z @ weight_t`` in place (``weight_t``: a weight's transpose, in x out, which a served hook takes
    once, not at every call: a transpose is an op the host dispatches), as one ``addmm_`` over the rows of the
    tokens where ``y`` is contiguous (a Linear's output); otherwise (a sum keeps the strides of its inputs) as a
    matmul and an add.  In ``y``'s dtype, as :func:`rows_matmul_`.
    """
    z, weight_t = _in_dtype(z, y.dtype), _in_dtype(weight_t, y.dtype)
    if y.is_contiguous():
        flat = z if z.dim() == 2 else z.reshape(-1, z.shape[-1])  # tokens_linear's result is already flat
        (y if y.dim() == 2 else y.view(-1, y.shape[-1])).addmm_(flat, weight_t, alpha=alpha)
    else:
        product = z @ weight_t
        y.add_(product.view(y.shape) if product.dim() != y.dim() else product, alpha=alpha)


def tokens_linear(x: Tensor, weight_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight_t.t(), bias)`` with ``x``'s tokens as the rows of one matrix (tokens x out), as a served
    hook feeds it on to :func:`add_matmul_`: one ``mm`` (``addmm`` with a bias) on a weight transposed once
    (``weight_t``, in x out).

    The same kernel on the same operands as ``F.linear``: for a contiguous ``x`` torch's ``at::linear`` (with a bias)
    and ``at::matmul`` (without) fold the leading dims into rows and call it on ``weight.t()``; without the ops they
    dispatch to get there (the weight's transpose, ``matmul``, the reshapes), about seven calls the host makes.  A
    non-contiguous ``x`` goes through ``F.linear`` itself, whose kernel may then differ.
    """
    if not x.is_contiguous():
        return F.linear(x, weight_t.t(), bias).flatten(0, -2)
    flat = x if x.dim() == 2 else x.view(-1, x.shape[-1])
    return flat.mm(weight_t) if bias is None else torch.addmm(bias, flat, weight_t)


# A hidden unit held at this value carries the next layer's bias through its matmul (see with_bias_unit).
BIAS_UNIT = 2.0**14


def with_bias_unit(
    down_w: Tensor, down_b: Tensor, up_w: Tensor, up_b: Tensor, act: Callable[[Tensor], Tensor]
) -> tuple[Tensor, Tensor, Tensor] | None:
    """``down`` with one more unit, always :data:`BIAS_UNIT`, and ``up`` with the column that turns it into ``up_b``.

    ``act(h down^T + down_b) up^T + up_b`` is then ``act(h down'^T + down_b') up'^T``: one matmul after the
    activation, which a served hook adds into its rows in place (:func:`add_matmul_`), where the bias would take an
    op of its own (the ones-column of homogeneous coordinates).  Exact: ``act`` must give the unit back (ReLU, GELU
    and SiLU give ``2^14`` back; checked here in float32 and bfloat16), and ``2^14 * (up_b / 2^14)`` is ``up_b``, a
    power of two.  ``None`` for an ``act`` that does not.
    """
    probe = torch.tensor([BIAS_UNIT])
    if not all(torch.equal(act(probe.to(dtype)), probe.to(dtype)) for dtype in (torch.float32, torch.bfloat16)):
        return None
    down_w = torch.cat([down_w, down_w.new_zeros(1, down_w.shape[1])])
    down_b = torch.cat([down_b, down_b.new_full((1,), BIAS_UNIT)])
    up_w = torch.cat([up_w, (up_b / BIAS_UNIT)[:, None]], dim=1)
    return down_w, down_b, up_w


def per_device(*tensors: Tensor) -> Callable[[Tensor], tuple[Tensor, ...]]:
    """``tensors`` (computed once from a task's weights) in the device and dtype of a batch ``x``: copied once per
    device and dtype, so that a per-task hook may use them after ``MultiTask.to()`` moved the task's own weights.
    An integer tensor (an index) keeps its dtype.
    """
    copies: dict[tuple[torch.device, torch.dtype], tuple[Tensor, ...]] = {}

    def like(x: Tensor) -> tuple[Tensor, ...]:
        key = (x.device, x.dtype)
        if key not in copies:
            copies[key] = tuple(t.detach().to(x.device, x.dtype if t.is_floating_point() else t.dtype) for t in tensors)
        return copies[key]

    return like


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
        batched: the batched form of ``post`` or ``pre`` (:class:`Batched`), if the method offers one.
        post_in_place: ``post_in_place(x, y, tokens)``: what ``post`` does, done on ``y`` itself (``y += update``).
            Used where the rows' ``y`` is the frozen module's fresh output and no autograd records (serving), so
            that a task's update costs its own ops and no copy of its rows back into the batch; ``post``, if not
            given, is a copy of ``y`` updated in place.
        branch_in_place: ``branch_in_place(h, tokens)``: what ``branch`` does, done on ``h`` itself, used as
            ``post_in_place`` is (``branch``, if not given, is a copy of ``h`` updated in place).
        room: the wrapper only lets the frozen attention take the task's extra tokens without a position of their
            own (``Backbone.make_room``: no relative-position bias, no rotation) and does nothing to the rows; the
            MultiTask gives its shared blocks the same room at the batch's prompt slots instead (a token without a
            position is attended alike wherever it sits, so the slots may hold what the task's own model puts at
            the front or the end of its sequence).
        beside: the task's prompts travel beside the tokens, not in slots of them (VPT's next to a Swin's grid,
            which has no room for them): its rows take a pass of their own through the frozen backbone
            (``Backbone.features_with_prompts``), each row with its own task's prompts; every hook of such a task
            says so (nothing of it is routed).
        own_prompts: (``beside``, at a block) the prompts the block puts in place of those arriving (count x
            width), or ``None`` to carry them.
        reads_input: whether ``post`` and ``post_in_place`` read ``x``; where not (SSF's scale and shift, a bias
            delta, a sequential adapter), they get ``None`` for it: slicing a task's rows of ``x`` is a view op the
            host dispatches at every call.

    """

    wrapped: nn.Module
    pre: Callable[[Tensor, Tokens], Tensor] | None = None
    post: Callable[[Tensor | None, Tensor, Tokens], Tensor] | None = None
    mid: Callable[[Tensor, Tokens], Tensor] | None = None
    branch: Callable[[Tensor, Tokens], Tensor] | None = None
    prompts: int = 0
    visible: int | None = None
    pool_prompts: bool = True
    batched: Batched | None = None
    post_in_place: Callable[[Tensor | None, Tensor, Tokens], None] | None = None
    branch_in_place: Callable[[Tensor, Tokens], None] | None = None
    room: bool = False
    beside: bool = False
    own_prompts: Tensor | None = None
    reads_input: bool = True

    def __post_init__(self) -> None:
        if self.post is None and self.post_in_place is not None:
            update = self.post_in_place

            def post(x: Tensor | None, y: Tensor, tokens: Tokens) -> Tensor:
                y = y.clone()
                update(x, y, tokens)
                return y

            object.__setattr__(self, "post", post)
        if self.branch is None and self.branch_in_place is not None:
            update_branch = self.branch_in_place

            def branch(h: Tensor, tokens: Tokens) -> Tensor:
                h = h.clone()
                update_branch(h, tokens)
                return h

            object.__setattr__(self, "branch", branch)


def room_hook(wrapper: nn.Module) -> RowHook:
    """The hook of a family's room wrapper (``Backbone.make_room``): :attr:`RowHook.room`, nothing on the rows."""
    return RowHook(wrapper.base, room=True)


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
