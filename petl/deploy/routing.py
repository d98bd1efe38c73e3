"""Routing one mixed batch through a shared frozen backbone: each task's hooks act on its own rows only.

:class:`RoutedModule` and :class:`RoutedBlock` stand in for the backbone's modules that some task wraps or trains;
:func:`task_sites` finds, for one task's model, the hook at each such place (:mod:`petl.model.rows`).

Hooks that offer a batched form (:class:`petl.model.rows.Batched`) with the same key are stacked once (:class:`Stack`)
and, when two or more of their tasks are in a batch, act in one op on the span of rows from their first task's
first row to their last task's last (the batch is sorted by task), each row with its own task's entry (the neutral
one for a row of a task between them); the other hooks act task by task on their rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from timm.layers import LayerScale
from torch import nn

from petl.model.backbone import backbone_of, block_family
from petl.model.rows import Batched, CannotShare, RowHook, Tokens, affine, per_device, registered_hook

Tensor = torch.Tensor


def check_images(images: Any, channels: int | None, size: tuple[int, ...] | None, dtype: torch.dtype) -> None:
    """A ValueError in one line for images a MultiTask's backbone cannot take: not a tensor, not N x C x H x W,
    another channel count, another size where the backbone holds to one (``size``), another dtype than its weights'
    (``dtype``; any floating dtype under autocast, which casts them).
    """
    if not isinstance(images, Tensor):
        raise ValueError(
            f"images are a {type(images).__name__}: give a tensor N x {channels or 'C'} x H x W, preprocessed"
        )
    if images.dim() != 4 or (channels is not None and images.shape[1] != channels):
        raise ValueError(f"images are {tuple(images.shape)}: give a batch N x {channels or 'C'} x H x W")
    if size is not None and tuple(images.shape[2:]) != size:
        raise ValueError(
            f"images are {images.shape[2]}x{images.shape[3]} px: the backbone takes {size[0]}x{size[1]}; "
            "preprocess them as the runs' cards say (petl.load_run(run).preprocess)"
        )
    # Else torch's own error: "Input type (unsigned char) and bias type (float) should be the same".
    if images.dtype != dtype and not (images.is_floating_point() and _autocast(images.device.type)):
        raise ValueError(
            f"images are {images.dtype}: the backbone's weights are {dtype}; give {dtype} images, preprocessed as "
            "the runs' cards say (petl.load_run(run).preprocess), or cast the MultiTask with .to(dtype)"
        )


def _autocast(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


def _own_parameter_hook(module: nn.Module, frozen: nn.Module, own: list[str]) -> RowHook | None:
    """The hook of a backbone module some of whose parameters the task trained itself (BitFit, LN tuning).

    A trained bias alone (BitFit), on a Linear, a Conv2d or a LayerNorm, is a delta added to the shared output; a
    trained LayerNorm weight or layer scale is cheap (no matmul): the task's rows go through its own module.  A
    trained weight matrix would need its own matmul per task, which is exactly what cannot be shared: None.
    """
    if isinstance(module, (nn.Linear, nn.Conv2d, nn.LayerNorm)) and own == ["bias"] and frozen.bias is not None:
        # The frozen output plus the bias's change: exact for a Linear or Conv2d, and for a LayerNorm (whose
        # weight is the frozen one) up to the rounding of one add.
        with torch.no_grad():
            return _delta_hook(frozen, module.bias - frozen.bias, 1 if isinstance(module, nn.Conv2d) else -1)
    if isinstance(module, (nn.LayerNorm, LayerScale)):
        return RowHook(frozen, post=lambda x, y, _tokens: module(x))
    return None


def _trains_frozen(model: nn.Module, frozen: dict[str, nn.Module], path: str, tensor: str) -> str:
    """Why a task that trained ``tensor`` (a frozen weight of the module at ``path``) cannot share the backbone, naming
    the outermost module on ``path`` it trained whole (a Partial-k block; the model, fine-tuned in full), which says
    more than the first such tensor the walk meets (a Swin block's relative-position table).
    """
    parts = path.split(".") if path else []
    for end in range(len(parts) + 1):
        prefix = ".".join(parts[:end])
        try:
            mine = model.get_submodule(prefix)
        except AttributeError:  # below a wrapper the model has a level (its base) the walk's paths skip
            break
        shared = {id(p) for p in frozen[prefix].parameters()}
        if not any(id(p) in shared for p in mine.parameters()):
            whole = f"all of {prefix}" if prefix else "every weight of the backbone"
            return (
                f"it trains {whole} ({tensor} among them), frozen weights every row's computation shares; use it "
                "as a model of its own (petl.load_run)"
            )
    return (
        f"it trains {tensor}, a frozen weight every row's computation shares; use it as a model of its own "
        "(petl.load_run)"
    )


def _delta_hook(frozen: nn.Module, delta: Tensor, channel_dim: int = -1) -> RowHook:
    """A task's change ``delta`` to the bias of ``frozen``'s output channels, added to its rows of that output."""
    shape = (-1, 1, 1) if channel_dim == 1 else (-1,)
    like = per_device(delta.view(shape))
    # Batched as a scale of one and a shift: it stacks with SSF's scale and shift at the same layer.
    batched = affine(torch.ones_like(delta), delta, channel_dim)
    return RowHook(frozen, post_in_place=lambda _x, y, _tokens: y.add_(like(y)[0]), batched=batched, reads_input=False)


def _biases_beside_hook(
    module: nn.Module, frozen: nn.Module, beside: tuple[str, dict[str, tuple[int, int]]]
) -> RowHook:
    """The hook, at ``frozen``'s Linear ``beside[0]``, of biases a module adds to that Linear's output (a SwinV2's
    q/v biases): their change, at their rows of the output.
    """
    name, rows = beside
    linear = getattr(frozen, name)
    with torch.no_grad():
        delta = torch.zeros(linear.out_features, dtype=linear.weight.dtype, device=linear.weight.device)
        for bias, (start, end) in rows.items():
            delta[start:end] = getattr(module, bias) - getattr(frozen, bias)
    return _delta_hook(linear, delta)


def _around(wrapper: RowHook, inner: RowHook) -> RowHook:
    """A wrapper's hook over a wrapped module that has its own parameters: ``inner.post`` first, then the wrapper's.

    The composition has no batched form (neither hook's alone does what both do): it acts on its own rows, in place
    where both hooks can (GPS's bias delta and sparse update: no copy of the rows, no copy back).
    """
    if wrapper.post is None:
        post, in_place = inner.post, inner.post_in_place
        return replace(wrapper, post=post, batched=None, post_in_place=in_place, reads_input=inner.reads_input)
    reads_input = wrapper.reads_input or inner.reads_input  # both get x where one reads it
    if wrapper.post_in_place is not None and inner.post_in_place is not None:
        inner_update, wrapper_update = inner.post_in_place, wrapper.post_in_place

        def both(x: Tensor | None, y: Tensor, tokens: Tokens) -> None:
            inner_update(x, y, tokens)
            wrapper_update(x, y, tokens)

        return replace(wrapper, post=None, batched=None, post_in_place=both, reads_input=reads_input)
    outer, first = wrapper.post, inner.post
    post = lambda x, y, tokens: outer(x, first(x, y, tokens), tokens)  # noqa: E731
    return replace(wrapper, post=post, batched=None, post_in_place=None, reads_input=reads_input)


@dataclass
class Batch:
    """The current forward's rows: (task index, first row, end row) per task present, and the token layout.

    ``rows``: each row's task index (a long tensor on the batch's device), for batched hooks; ``gathered``
    caches, per table of :class:`StackTables` and span of rows, each of those rows' entry of it (one gather per
    batch).  ``launch_bound``: whether launching an op costs more than a small op's arithmetic (a GPU), which
    decides when a stack serves (:meth:`Stack.span`).  ``every_row``: every stack acts on every row, whichever tasks
    the batch holds, and no hook on its own rows (a :class:`Router` built ``every_row``): the ops do not depend on
    the batch's mix of tasks, only on its size.
    """

    groups: list[tuple[int, int, int]]
    tokens: Tokens
    rows: Tensor | None = None
    launch_bound: bool = True
    every_row: bool = False
    gathered: dict[tuple[int, int, int], tuple[Tensor, ...]] = field(default_factory=dict)
    repeated: dict[int, Batch] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Task -> its rows (a slice), looked up by every routed module for its few tasks instead of a walk over all.
        self.spans = {task: slice(start, end) for task, start, end in self.groups}
        self.images = self.groups[-1][2] if self.groups else 0
        # Per set of stacked tasks (and whether a pre): the rows its stacks act on (Stack.span), decided once.
        self.serving: dict[tuple[tuple[int, ...], bool], slice | None] = {}

    def rows_of(self, x: Tensor) -> Batch:
        """The batch as ``x``'s rows see it: each image ``k`` consecutive rows where ``x`` has ``k`` per image.

        A Swin's window attention sees each image as its windows, one after the other (timm's
        ``window_partition`` keeps the image first), so its qkv and proj get ``windows x images`` rows.
        """
        images = self.images
        if not images or x.shape[0] == images:
            return self
        k, rest = divmod(x.shape[0], images)
        if rest:
            raise RuntimeError(f"a routed module got {x.shape[0]} rows for {images} images")
        if k not in self.repeated:
            groups = [(task, start * k, end * k) for task, start, end in self.groups]
            rows = None if self.rows is None else self.rows.repeat_interleave(k)
            self.repeated[k] = Batch(groups, self.tokens, rows, self.launch_bound, self.every_row)
        return self.repeated[k]


class Router:
    """Holds the batch being served, for every routed module of one :class:`MultiTask` (set only inside forward).

    Args:
        tasks: how many tasks the MultiTask serves (the size of a stack's task-to-entry table).

    """

    batch: Batch | None = None

    def __init__(self, tasks: int = 0, every_row: bool = False) -> None:
        self.tasks = tasks
        self.tables = StackTables(tasks)
        # Every batched form stacked, one task's alone too, so that a batch may run every_row (see Batch).
        self.every_row = every_row

    def current(self) -> Batch:
        if self.batch is None:
            raise RuntimeError("a MultiTask's routed backbone runs only inside MultiTask.forward")
        return self.batch


def _take(t: Tensor, rows: slice) -> Tensor:
    """``t[rows]``, or ``t`` itself where ``rows`` are all of its rows (one task's batch): a slice is a view op the
    host dispatches, at every routed module of every call.
    """
    return t if rows.stop - rows.start == t.shape[0] else t[rows]


def _each_task(
    batch: Batch, hooks: dict[int, RowHook], x: Tensor, act: Callable[[RowHook, slice], Any], own: bool = False
) -> Tensor:
    """``x`` with each task's rows replaced by ``act(hook, rows)``, where the task has a hook that acts (not None).

    ``own``: ``x`` is a fresh result of the calling module that nothing else holds, so without autograd the rows
    are written into it in place; otherwise (an input, which the caller still uses) the result is a new tensor.
    Copying the whole batch at every routed module would cost about as much as a small backbone's matmuls.
    """
    acted = []
    for task, hook in hooks.items():
        rows = batch.spans.get(task)
        out = None if rows is None else act(hook, rows)
        if out is not None:
            if rows.stop - rows.start == x.shape[0]:  # one task's batch
                return out
            acted.append((rows.start, rows.stop, out))
    if not acted:
        return x
    if own and not torch.is_grad_enabled():
        for start, end, out in acted:
            x[start:end].copy_(out)
        return x
    # A new tensor: each acted task's rows, and the untouched rows between them as one slice each.
    parts, row = [], 0
    for start, end, out in sorted(acted, key=lambda item: item[0]):
        if start > row:
            parts.append(x[row:start])
        parts.append(out)
        row = end
    if row < x.shape[0]:
        parts.append(x[row:])
    return torch.cat(parts)


def _is_fresh(y: Tensor, x: Tensor) -> bool:
    """Whether a module's output ``y`` is a new tensor rather than (a view of) its input ``x`` (nn.Identity's)."""
    return y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


class StackTables(nn.Module):
    """Every stack's tensors, per set of stacked tasks and dtype, side by side in one table (task index x elements:
    a stacked task's own entry, the neutral one for every other task).

    A batch gathers the entries of a table's rows (its stacks' span: :meth:`Stack.span`) once, at the first stack
    that needs them, and the stacks of every module read their views of them: one gather per set of tasks and dtype
    for the whole forward, not one per module (each is an op the host launches).  The gathered rows live until the
    forward ends: the span's rows x the stacked tensors of the task sets present, as large as the per-module gathers
    were in all.  The tables are buffers (not saved: a MultiTask is built from its task files; moved by ``.to()``).

    Args:
        tasks: how many tasks the MultiTask serves (the size of each task-to-entry table).

    """

    def __init__(self, tasks: int) -> None:
        super().__init__()
        self.tasks = tasks
        self._columns: dict[tuple[tuple[int, ...], torch.dtype], list[Tensor]] = {}
        self._table: dict[tuple[tuple[int, ...], torch.dtype], int] = {}
        self._sizes: dict[int, list[int]] = {}
        self._shapes: dict[int, list[torch.Size | None]] = {}  # per table, each column's entry shape (None: vector)
        self._vectors: set[int] = set()  # the tables holding a vector column
        self._matrices: set[int] = set()  # the tables holding a column of another shape

    def add(self, tasks: tuple[int, ...], column: Tensor, shape: torch.Size | None = None) -> tuple[int, int]:
        """Put ``column`` (entries x elements: the stacked tasks' and the neutral one last) into the table of
        ``tasks`` and its dtype, each entry of ``shape`` (None: a vector, one value per channel); returns (table,
        index of the column in it), valid once :meth:`build` has run.
        """
        key = (tasks, column.dtype)
        columns = self._columns.setdefault(key, [])
        if key not in self._table:
            self._table[key] = len(self._table)
        table = self._table[key]
        (self._vectors if shape is None else self._matrices).add(table)
        self._shapes.setdefault(table, []).append(shape)
        columns.append(column)
        return table, len(columns) - 1

    def build(self) -> None:
        """Make the tables of everything added (once every routed module is built): one row per task index, its own
        entry for a stacked task and the neutral one (the last) for every other, so that a batch gathers each row's
        entry in one op.
        """
        for key, table in self._table.items():
            tasks, columns = key[0], self._columns[key]
            entry = torch.full((max(self.tasks, max(tasks) + 1),), len(tasks), dtype=torch.long)
            entry[list(tasks)] = torch.arange(len(tasks))
            self.register_buffer(f"table_{table}", torch.cat(columns, dim=1)[entry], persistent=False)
            self._sizes[table] = [column.shape[1] for column in columns]
        self._columns = {}

    def rows(self, batch: Batch, table: int, span: slice) -> tuple[Tensor, ...]:
        """The entry of each column of ``table`` of every row in ``span``, in its stack's shape (rows x the entry's
        shape; a vector as rows x 1 x elements), gathered once per batch.

        Rows x 1 x elements: a vector column (a scale, a shift, a bias) is then in the shape that broadcasts over
        the tokens as gathered, where taking that view at each use would be an op the host dispatches (two per
        SSF or BitFit site); one view of the gathered rows makes it for every column.  A matrix column's view is
        taken here too, once per batch as at its one use, so that a stack's rows are a slice of this tuple.
        """
        key = (table, span.start, span.stop)
        columns = batch.gathered.get(key)
        if columns is None:
            # index_select: the gather ``table[rows]`` is, in one op without indexing's views (the span's rows of
            # ``batch.rows`` are a view of them, or all of them).
            gathered = getattr(self, f"table_{table}").index_select(0, _take(batch.rows, span))
            if table in self._vectors:
                columns = gathered.unsqueeze(1).split(self._sizes[table], dim=2)
            else:  # matrices only (low-rank updates)
                columns = gathered.split(self._sizes[table], dim=1)
            if table in self._matrices:
                shapes = zip(columns, self._shapes[table], strict=True)
                columns = tuple(column if shape is None else column.view(-1, *shape) for column, shape in shapes)
            batch.gathered[key] = columns
        return columns


class Stack:
    """The tensors of the hooks at one module that share a :class:`Batched` key, stacked once: one op per batch, over
    the span of its tasks' rows (:meth:`span`).

    Each tensor of the key's tasks, and the neutral entry last (for the rows of every other task), zero-padded where
    the form allows it (``pad``), is stacked on a new first dimension and put in the router's :class:`StackTables`,
    where a batch gathers every row's entries for all the stacks of these tasks at once.

    Args:
        forms: task index -> that task's batched form (all with the same key).
        router: the owning MultiTask's router.

    """

    def __init__(self, forms: dict[int, Batched], router: Router) -> None:
        first = next(iter(forms.values()))
        self.pre, self.post, self.tasks = first.pre, first.post, tuple(sorted(forms))
        self.post_in_place, self.reads_input = first.post_in_place, first.reads_input
        self.tables = router.tables
        self.key = (self.tasks, self.pre is not None)  # its span's in Batch.serving
        # Per tensor: (table, its column there); the table gathers each column in the tensor's shape (a vector as
        # rows x 1 x entry, the shape it broadcasts in over the tokens).
        self.parts: list[tuple[int, int]] = []
        for i, pad in enumerate(first.pad or (None,) * len(first.tensors)):
            column = [forms[task].tensors[i] for task in self.tasks] + [first.neutral[i]]
            if pad is not None:
                size = max(t.shape[pad] for t in column)
                column = [_zero_pad(t, pad, size) for t in column]
            stacked = torch.stack(column)
            shape = stacked.shape[1:] if stacked.dim() != 2 else None
            self.parts.append(self.tables.add(self.tasks, stacked.flatten(1), shape))
        # Its columns, added one after the other, are one slice of a table's where its tensors share a dtype: its
        # rows are then a slice of the gathered tuple (no tuple built per call).
        table, column = self.parts[0]
        one_run = all(part == (table, column + i) for i, part in enumerate(self.parts))
        self.run = (table, column, column + len(self.parts)) if one_run else None

    def span(self, batch: Batch) -> slice | None:
        """The rows of ``batch`` its one op acts on, or None where its tasks' hooks act on their own rows instead.

        A ``post`` acts on the span from the first row of its first task in the batch to the last row of its last:
        the batch is sorted by task, so the span holds only the rows of tasks between them besides its own, and
        those take the neutral entry.  A ``pre`` acts on every row: its input is one the caller still uses, so its
        op builds a new tensor of every row anyway (VPT's prompts written into every row's slots), where acting on
        a span would take one more copy of the batch to put the rows around it back.

        Never for one task alone.  Where launching ops is the cost (a GPU), whenever two or more of its tasks are
        in the batch: one op instead of one per task.  Where the arithmetic is (a CPU), only when its tasks hold
        at least half of the rows its op computes: its op computes the other tasks' rows in it too, and with more
        of them than of its own it costs more than its tasks' own ops on their rows (the 8-method set at 8 rows
        per task ran at 0.61x the plain backbone with every pair stacked over the whole batch, 0.86x with none, on
        a 2-core CPU; with SSF's and BitFit's stack over their own 16 rows, adjacent in the batch, as fast as with
        none, within 2%).
        """
        if batch.every_row:
            return slice(0, batch.images)
        if self.key in batch.serving:  # decided once per batch for every stack of these tasks
            return batch.serving[self.key]
        spans = [batch.spans[task] for task in self.tasks if task in batch.spans]
        span = None
        if len(spans) >= 2:
            if self.pre is not None:
                span = slice(0, batch.images)
            else:
                span = slice(min(s.start for s in spans), max(s.stop for s in spans))
            rows = sum(s.stop - s.start for s in spans)
            if not batch.launch_bound and 2 * rows < span.stop - span.start:
                span = None
        batch.serving[self.key] = span
        return span

    def rows(self, batch: Batch, span: slice) -> tuple[Tensor, ...]:
        """Each stacked tensor as each row's own, for the rows of its :meth:`span` (rows first; a vector as rows x 1
        x entry): views of the rows its tables gathered.
        """
        if self.run is not None:
            table, first, end = self.run
            return self.tables.rows(batch, table, span)[first:end]
        return tuple(self.tables.rows(batch, table, span)[column] for table, column in self.parts)

    def act(self, batch: Batch, span: slice, x: Tensor, y: Tensor, own: bool) -> Tensor:
        """``y`` with its ``post`` applied to the rows of its :meth:`span`, ``span``.

        Over the whole batch, ``post``'s result.  Over a span, where ``y`` is the frozen module's fresh output
        (``own``) and no autograd records, the span's rows of ``y`` itself are written (``post_in_place``, in as
        many ops as ``post``; else a copy of ``post``'s result); otherwise a new tensor of ``y``'s rows before the
        span, the span's result and the rows after it.
        """
        rows = self.rows(batch, span)
        x = _take(x, span) if self.reads_input else None  # a post that reads y alone gets None, no slice of x
        if span.stop - span.start == y.shape[0]:
            return self.post(x, y, rows)
        y_span = y[span]
        if own and not torch.is_grad_enabled():
            if self.post_in_place is not None:
                self.post_in_place(x, y_span, rows)
            else:
                y_span.copy_(self.post(x, y_span, rows))
            return y
        parts = (y[: span.start], self.post(x, y_span, rows), y[span.stop :])
        return torch.cat([part for part in parts if part.shape[0]])


def _zero_pad(t: Tensor, dim: int, size: int) -> Tensor:
    """``t`` with zeros appended along ``dim`` up to ``size``."""
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _stacks(hooks: dict[int, RowHook], router: Router) -> list[Stack]:
    """One :class:`Stack` per batched key at a module that two or more tasks' hooks share (every key, with a router
    built ``every_row``).

    A key of one task serves unstacked: gathering each of its tensors for every row launches more kernels than
    acting on its own rows (the only way where a batch runs ``every_row``).
    """
    by_key: dict[Any, dict[int, Batched]] = {}
    for task, hook in hooks.items():
        form = hook.batched
        if form is not None:
            pads = form.pad or (None,) * len(form.tensors)
            shapes = tuple(
                (tuple(n for d, n in enumerate(t.shape) if d != pad), t.dtype, t.device)
                for t, pad in zip(form.tensors, pads, strict=True)
            )
            by_key.setdefault((form.key, shapes), {})[task] = form
    return [Stack(forms, router) for forms in by_key.values() if len(forms) >= 2 or router.every_row]


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
        self.stacks = _stacks(hooks, router)
        self._kinds()
        for task, hook in hooks.items():
            if hook.mid or hook.branch or hook.visible is not None:
                raise CannotShare(f"task {task}: a hook inside a block's halves belongs on a block, not here")

    def _kinds(self) -> None:
        """Per kind, only the tasks whose hook acts there (a task without one costs no slice of its rows), and what
        of it every call does, worked out once (again where ``stacks`` changes).

        ``pre_stacks`` and ``post_stacks``: each stack of the kind with its tasks' hooks, which act on their own rows
        in a batch where the stack does not serve; ``pre_alone`` and ``post_alone``: the hooks in no stack.  A stack
        of one task (a router built ``every_row``) is for batches that run ``every_row`` only (``every_pre``,
        ``every_post``); in the others its task's hook acts alone.  ``every_row``: whether every hook here is in a
        stack, as a batch run ``every_row`` needs.
        """
        hooks = self.hooks
        self.pre_hooks = {task: hook for task, hook in hooks.items() if hook.pre}
        self.post_hooks = {task: hook for task, hook in hooks.items() if hook.post}
        self.mid_hooks = {task: hook for task, hook in hooks.items() if hook.mid}
        self.branch_hooks = {task: hook for task, hook in hooks.items() if hook.branch}
        shared = [stack for stack in self.stacks if len(stack.tasks) >= 2]
        self.pre_stacks = [
            (stack, {task: self.pre_hooks[task] for task in stack.tasks if task in self.pre_hooks})
            for stack in shared
            if stack.pre is not None
        ]
        self.post_stacks = [
            (stack, {task: self.post_hooks[task] for task in stack.tasks if task in self.post_hooks})
            for stack in shared
            if stack.post is not None
        ]
        stacked_pre = {task for _, stacked in self.pre_stacks for task in stacked}
        stacked_post = {task for _, stacked in self.post_stacks for task in stacked}
        self.pre_alone = {task: hook for task, hook in self.pre_hooks.items() if task not in stacked_pre}
        self.post_alone = {task: hook for task, hook in self.post_hooks.items() if task not in stacked_post}
        self.any_pre = bool(self.pre_hooks or self.pre_stacks)
        self.any_post = bool(self.post_hooks or self.post_stacks)
        self.every_pre = [(stack, {}) for stack in self.stacks if stack.pre is not None]
        self.every_post = [(stack, {}) for stack in self.stacks if stack.post is not None]
        in_pre = {task for stack, _ in self.every_pre for task in stack.tasks}
        in_post = {task for stack, _ in self.every_post for task in stack.tasks}
        self.every_row = (
            set(self.pre_hooks) <= in_pre
            and set(self.post_hooks) <= in_post
            and not self.mid_hooks
            and not self.branch_hooks
            and all(hook.visible is None for hook in hooks.values())
        )

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        batch = self._router.current()
        if x.shape[0] != batch.images:  # a Swin's windows: several rows per image
            batch = batch.rows_of(x)
        if self.any_pre:
            x = self._pre(batch, x)
        y = self.base(x, *args, **kwargs)
        if not self.any_post:
            return y
        return self._post(batch, x, y, own=_is_fresh(y, x))

    def _pre(self, batch: Batch, x: Tensor) -> Tensor:
        """``x`` with every task's pre hook applied to its rows: stacked hooks in one op each, the rest per task."""
        stacks, hooks = (self.every_pre, {}) if batch.every_row else (self.pre_stacks, self.pre_alone)
        for stack, stacked in stacks:
            span = stack.span(batch)
            if span is not None:
                # Every row at once; rows of tasks outside the stack get its neutral entry and stay as they are.
                x = stack.pre(x, batch.tokens, stack.rows(batch, span))
            elif stacked:
                hooks = {**hooks, **stacked}
        if not hooks:
            return x
        return _each_task(batch, hooks, x, lambda h, rows: h.pre(_take(x, rows), batch.tokens))

    def _post(self, batch: Batch, x: Tensor, y: Tensor, own: bool) -> Tensor:
        """``y`` with every task's post hook applied to its rows: stacked hooks in one op each, the rest per task."""
        stacks, hooks = (self.every_post, {}) if batch.every_row else (self.post_stacks, self.post_alone)
        for stack, stacked in stacks:
            span = stack.span(batch)
            if span is not None:
                # Its span of rows at once; rows of tasks outside the stack there get its neutral entry.
                y, own = stack.act(batch, span, x, y, own), True
            elif stacked:
                hooks = {**hooks, **stacked}
        if not hooks:
            return y
        # Serving: a hook that can acts on its rows of the fresh output itself, with no copy back.
        in_place = own and not torch.is_grad_enabled()
        rest = {}
        for task, hook in hooks.items():
            rows = batch.spans.get(task)
            if rows is None:
                continue
            if in_place and hook.post_in_place is not None:
                # A hook that reads y alone gets None for x: no slice of x's rows.
                hook.post_in_place(_take(x, rows) if hook.reads_input else None, _take(y, rows), batch.tokens)
            else:
                rest[task] = hook
        if not rest:
            return y
        post = lambda h, rows: h.post(_take(x, rows) if h.reads_input else None, _take(y, rows), batch.tokens)  # noqa: E731
        return _each_task(batch, rest, y, post, own=own)


class RoutedBlock(RoutedModule):
    """A frozen transformer block run once for the whole batch; tasks hook before it, between its halves, after it.

    With a ``mid`` or ``branch`` hook the block runs as its two residual halves (timm's pre-norm ``Block``), so that
    ``mid`` can act on the stream between them and ``branch`` on the MLP's branch before its residual sum; a
    ``post`` hook reads the stream entering the MLP half (``Backbone.mlp_input_and_output``: a parallel block's
    input, where there are no halves).
    """

    def __init__(self, base: nn.Module, hooks: dict[int, RowHook], router: Router) -> None:
        nn.Module.__init__(self)
        self.base = base
        self.hooks, self._router = hooks, router
        self.stacks = _stacks(hooks, router)
        self._kinds()
        self.halves = any(h.mid or h.branch or h.post for h in hooks.values())
        self.branches = any(h.branch for h in hooks.values())
        self.family = None
        try:
            self.family = block_family(base)
        except ValueError as error:
            if self.halves:
                raise CannotShare(str(error)) from None
        else:
            # A block that passes its attention no mask (a relpos ViT's, BEiT's) runs as its halves, which do.
            self.halves = self.halves or not self.family.blocks_take_mask

    def forward(self, x: Tensor, **kwargs: Any) -> Tensor:
        batch = self._router.current()
        if self.any_pre:
            x = self._pre(batch, x)
        if not self.halves:
            return self.base(x, **kwargs)
        if not self.mid_hooks and not self.branches:
            # Post hooks alone: they read the stream entering the MLP half (a parallel block's input) and the output.
            x, y = self.family.mlp_input_and_output(self.base, x, **kwargs)
            return self._post(batch, x, y, own=True)
        # Each half ends with a residual sum, a fresh tensor this block owns.
        x = self.family.attn_residual(self.base, x, **kwargs)
        x = _each_task(batch, self.mid_hooks, x, lambda h, rows: h.mid(_take(x, rows), batch.tokens), own=True)
        if self.branches:
            h = self.family.mlp_branch(self.base, x)
            own, hooks = _is_fresh(h, x), self.branch_hooks
            if own and not torch.is_grad_enabled():
                # Serving: a hook that can adds into its rows of the fresh branch itself, with no copy back.
                hooks = {}
                for task, hook in self.branch_hooks.items():
                    rows = batch.spans.get(task)
                    if rows is not None and hook.branch_in_place is not None:
                        hook.branch_in_place(_take(h, rows), batch.tokens)
                    else:
                        hooks[task] = hook
            branch = lambda hook, rows: hook.branch(_take(h, rows), batch.tokens)  # noqa: E731
            h = _each_task(batch, hooks, h, branch, own=own)
            y = x + h
        else:
            y = self.family.mlp_residual(self.base, x)
        return self._post(batch, x, y, own=True)


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
    bb = backbone_of(backbone)
    shared = {id(m) for m in bb.batch_shared_modules()}
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
        if id(plain) in shared and [id(p) for p in module.parameters()] != [id(p) for p in plain.parameters()]:
            raise CannotShare(f"it trains {path}, which computes a table every row of the batch shares")
        own = [n for n, p in module.named_parameters(recurse=False) if p is not getattr(plain, n, None)]
        beside = bb.biases_beside(plain) if own else None
        if beside is not None and set(own) <= set(beside[1]):
            add(f"{path}.{beside[0]}", _biases_beside_hook(module, plain, beside))
        elif own:
            hook = _own_parameter_hook(module, plain, own)
            if hook is None:
                raise CannotShare(_trains_frozen(model, frozen, path, f"{path}.{own[0]}" if path else own[0]))
            wrapper = sites.get(path)
            if wrapper is not None and wrapper.wrapped is module:  # GPS: a wrapper over a layer with its own bias
                sites[path] = _around(wrapper, hook)
            else:
                add(path, hook)
        for name, child in module.named_children():
            walk(child, f"{path}.{name}" if path else name)

    walk(model, "")
    return sites
