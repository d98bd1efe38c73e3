"""Many tasks, one backbone: serve a batch whose rows belong to different tasks over one frozen ViT.

    mt = petl.MultiTask(backbone, {"cars": "runs/cars", "pets": "pets/trainable.safetensors"})
    logits = mt(images, ["cars", "pets", "cars", ...])   # row i: task_ids[i]'s logits
    mt = petl.MultiTask.from_runs(["runs/cars", "runs/dtd"])   # the backbone their model.json records

A run folder's card (``model.json``) says which backbone the run trained on: served over another (another
architecture, resolution, or frozen tensors), the task is refused naming the difference.

Each task is a file written by :func:`petl.save_trainable` (a ``petl-run`` folder holds one as
``trainable.safetensors``); it is loaded with :func:`petl.load_trainable` onto a copy of the backbone
whose frozen tensors *are* the backbone's (shared, not copied), so a task costs its own tensors only.

How rows of different tasks share the frozen work: the batch is sorted by task, so each task's rows
form one contiguous slice.  Every module a task's method wraps (or whose own parameters it trains, as
BitFit and LN tuning do) is replaced, in one routed copy of the backbone, by a module that runs the
frozen module **once over the whole batch** and then lets each task's :class:`RowHook` act on its own
slice: before it (RepAdapter's input adapter, IA3's input scale), after it (LoRA's ``B A x``, FacT,
Hydra, GPS's sparse update, SSF's scale and shift, a bias delta, a bottleneck adapter's branch), or, for
a block, between its attention and MLP halves (SCT, SNF's shortcut flows) or on its MLP branch (NOAH's
adapter).  A side network (DTL, LST, HST, LAST) hooks every block: it reads its own rows of the shared
blocks' inputs and outputs and runs on those rows alone.  Modules no task touches run as they are.  VPT's
prompts live in slots right after the class/register tokens, as many as the batch's longest prompt set; each row
writes its own prompts there, and an attention mask keeps every row from attending slots it does not
use (and an average pooling from counting them), so a row sees exactly the tokens its own model would.
HST's meta tokens and NOAH's trailing prompts use the same slots (attention does not depend on where a
token sits); a task whose prompts change from block to block (NOAH) gives each block's count.

A method opts in next to its wrapper: ``@register_row_hook(MyWrapper)`` on a function that says what
the wrapper does to its rows (see ``petl/methods/lora.py``).  A task whose model holds a module no
hook covers (a peft tuner other than LoRA, DoRA or IA3), or trains a frozen weight matrix that every
row's matmul shares (Partial-k, full fine-tuning), is refused with one line naming its method.
Inference only: the tasks are in eval mode.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from timm.layers import LayerScale
from torch import nn

from petl import vit
from petl.core import apply, trainable_state
from petl.io import load_trainable, meta_copy, read_trainable_metadata

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


class TaskRefused(ValueError):
    """:class:`MultiTask` refuses a task: ``task`` names it, the one-line message says why.

    A caller serving many runs (``petl-predict``) can serve the others together and this one on its own.
    """

    def __init__(self, task: str, message: str) -> None:
        super().__init__(message)
        self.task = task


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


def _registered_hook(module: nn.Module) -> RowHook | None:
    for cls, make in _ROW_HOOKS:
        if isinstance(module, cls):
            return make(module)
    return None


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
class _Batch:
    """The current forward's rows: (task index, first row, end row) per task present, and the token layout."""

    groups: list[tuple[int, int, int]]
    tokens: Tokens


class _Router:
    """Holds the batch being served, for every routed module of one :class:`MultiTask` (set only inside forward)."""

    batch: _Batch | None = None

    def current(self) -> _Batch:
        if self.batch is None:
            raise RuntimeError("a MultiTask's routed backbone runs only inside MultiTask.forward")
        return self.batch


def _each_task(
    batch: _Batch, hooks: dict[int, RowHook], x: Tensor, act: Callable[[RowHook, slice], Any], own: bool = False
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

    def __init__(self, base: nn.Module, hooks: dict[int, RowHook], router: _Router) -> None:
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

    def __init__(self, base: nn.Module, hooks: dict[int, RowHook], router: _Router) -> None:
        nn.Module.__init__(self)
        self.base = base
        self.hooks, self._router = hooks, router
        self.halves = any(h.mid or h.branch or h.post for h in hooks.values())
        self.branches = any(h.branch for h in hooks.values())
        if self.halves:
            try:
                vit.check_pre_norm_block(base)
            except ValueError as error:
                raise CannotShare(str(error)) from None

    def forward(self, x: Tensor, **kwargs: Any) -> Tensor:
        batch = self._router.current()
        x = _each_task(batch, self.hooks, x, lambda h, rows: h.pre and h.pre(x[rows], batch.tokens))
        if not self.halves:
            return self.base(x, **kwargs)
        # Each half ends with a residual sum, a fresh tensor this block owns.
        x = vit.attn_residual(self.base, x, **kwargs)
        x = _each_task(batch, self.hooks, x, lambda h, rows: h.mid and h.mid(x[rows], batch.tokens), own=True)
        if self.branches:
            h = vit.mlp_branch(self.base, x)
            branch = lambda hook, rows: hook.branch and hook.branch(h[rows], batch.tokens)  # noqa: E731
            h = _each_task(batch, self.hooks, h, branch, own=_is_fresh(h, x))
            y = x + h
        else:
            y = vit.mlp_residual(self.base, x)
        post = lambda h, rows: h.post and h.post(x[rows], y[rows], batch.tokens)  # noqa: E731
        return _each_task(batch, self.hooks, y, post, own=True)


def _weights_file(path: str | Path) -> Path:
    """A task's weights: the file itself, or ``trainable.safetensors`` inside a run folder."""
    from petl.run.records import WEIGHTS_FILE

    path = Path(path)
    return path / WEIGHTS_FILE if path.is_dir() else path


def _run_card(path: str | Path) -> dict[str, Any] | None:
    """A run folder's checked card (:func:`petl.run.load.read_card`), or ``None`` for a weights file."""
    from petl.run import load

    path = Path(path)
    return load.read_card(path) if path.is_dir() and (path / load.MODEL_FILE).is_file() else None


def _trained_backbone_tensors(backbone: nn.Module, path: Path) -> set[str]:
    """The names of the backbone's tensors that the method in ``path`` trains, wherever it moves them.

    BitFit's biases keep their backbone names in the file, but GPS trains the biases of the layers it wraps
    (``blocks.0.attn.qkv.base.bias``) and HST the LayerNorms of the blocks it wraps: the method is built on a
    meta-device copy of the backbone (nothing allocated) and its trained tensors are matched to the backbone's
    by identity, so that loading never writes into a tensor the tasks share.
    """
    meta = read_trainable_metadata(path)
    shadow = meta_copy(backbone)
    names = {id(t): n for n, t in [*shadow.named_parameters(), *shadow.named_buffers()]}
    try:
        applied = apply(shadow, meta["method"], **meta["config"])
    except (ValueError, TypeError) as error:  # as load_trainable words it
        raise ValueError(f"{path}: cannot apply its method {meta['method']!r}: {error}") from None
    objects = {**dict(applied.named_parameters()), **dict(applied.named_buffers())}
    return {names[id(objects[n])] for n in trainable_state(applied) if id(objects.get(n)) in names}


def _shared_copy(backbone: nn.Module, unshared: set[str] = frozenset()) -> nn.Module:
    """A copy of ``backbone`` whose parameters and buffers are the backbone's own objects, except ``unshared``."""
    tensors = [*backbone.named_parameters(), *backbone.named_buffers()]
    memo = {id(t): t for name, t in tensors if name not in unshared}
    return copy.deepcopy(backbone, memo)


def _method_name(model: nn.Module) -> str:
    """The task's method for messages; the peft bridge's tuner type with it (``peft LOHA``)."""
    method = str(model.petl_method)
    peft_type = getattr(model.petl_config, "peft_type", None)
    return f"{method} {peft_type}" if peft_type else method


def _task_sites(model: nn.Module, backbone: nn.Module) -> dict[str, RowHook]:
    """Backbone module path -> this task's hook there, for every module its method wraps or trains.

    Walks the task's model along the backbone's module tree: a registered wrapper gives its hook (and the
    walk goes on inside the module it wraps, at the same path); a backbone module holding parameters of its
    own (not the backbone's) gets :func:`_own_parameter_hook`; anything else the backbone does not have at
    that path, or has with another type, is a wrapper without a hook.  The head is the task's own.
    """
    frozen = dict(backbone.named_modules())
    head = vit.head(model)
    sites: dict[str, RowHook] = {}

    def add(path: str, hook: RowHook) -> None:
        if path in sites:
            raise CannotShare(f"it modifies {path or 'the model'} twice, which no hook composes")
        sites[path] = hook

    def walk(module: nn.Module, path: str) -> None:
        if module is head:
            return
        hook = _registered_hook(module)
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


def _block_paths(backbone: nn.Module) -> list[str]:
    """The module paths of the backbone's blocks, in order."""
    paths = {id(m): path for path, m in backbone.named_modules()}
    return [paths[id(b)] for b in vit.block_container(backbone)]


class MultiTask(nn.Module):
    """Several tasks' trained PETL modules over one shared frozen ViT, serving batches of mixed tasks.

    Args:
        backbone: the plain timm ViT the tasks were trained on (no petl method applied); its parameters are
            shared by every task, never copied (and are set not to require grad).
        tasks: task name -> a ``.safetensors`` file from :func:`petl.save_trainable` or a ``petl-run`` run
            folder holding ``trainable.safetensors`` (checked against ``backbone`` by its ``model.json``).  Any mix
            of methods that can share (see the module doc).

    Raises:
        ValueError: a file that does not load onto ``backbone`` (the message names it), or a task that cannot
            share the backbone (the message names the task and its method), or a run trained on another backbone
            (:class:`TaskRefused`, naming the task and the difference).

    """

    def __init__(self, backbone: nn.Module, tasks: Mapping[str, str | Path]) -> None:
        super().__init__()
        if getattr(backbone, "petl_method", None) is not None:
            raise ValueError(f"pass the plain backbone: this one carries petl method {backbone.petl_method!r}")
        vit.check_vit(backbone)
        if not tasks:
            raise ValueError("MultiTask needs at least one task")
        backbone.requires_grad_(False).eval()
        self.names = [str(name) for name in tasks]
        models, hooks = [], []
        for name, path in tasks.items():
            card = _run_card(path)
            if card is None:  # a weights file alone: nothing records its backbone
                model = self._load(name, _weights_file(path), backbone)
            else:
                model = self._load_run(str(name), Path(path), card, backbone)
            try:
                sites = _task_sites(model, backbone)
            except CannotShare as error:
                method = _method_name(model)
                raise TaskRefused(name, f"task {name!r} (method {method}) cannot share the backbone: {error}") from None
            models.append(model)
            hooks.append(sites)
        # The task models own the trained tensors (so .to() moves them); their frozen tensors are the backbone's.
        self.tasks = nn.ModuleList(models)
        self.num_classes = {name: vit.num_classes(m) for name, m in zip(self.names, models, strict=True)}
        self.prompts = [max((h.prompts for h in sites.values()), default=0) for sites in hooks]
        self.pool_prompts = [all(h.pool_prompts for h in sites.values()) for sites in hooks]
        # Per task, per block: how many of its slots the block's tokens attend (all, unless a block hook says).
        blocks = _block_paths(backbone)
        self.visible = [
            [n if sites.get(b) is None or sites[b].visible is None else sites[b].visible for b in blocks]
            for sites, n in zip(hooks, self.prompts, strict=True)
        ]
        self._router = _Router()
        self.backbone = self._route(backbone, hooks)
        if any(self.prompts) and vit.pool_type(backbone) not in vit.MASKABLE_POOLS:
            task = self.names[next(i for i, n in enumerate(self.prompts) if n)]
            raise TaskRefused(
                task,
                f"task {task!r} adds prompt tokens, which a mixed batch cannot leave out of the backbone's "
                f"{vit.pool_type(backbone)!r} pooling yet (only {', '.join(vit.MASKABLE_POOLS)})",
            )
        self.eval()

    @classmethod
    def from_runs(cls, runs: Sequence[str | Path] | Mapping[str, str | Path]) -> MultiTask:
        """A MultiTask over the backbone the runs' cards (``model.json``) record, built once for all of them.

        Args:
            runs: ``petl-run`` folders (each named by its path), or task name -> folder.

        Raises:
            ValueError: runs trained on different backbones (the message names the run and the first difference),
                or a folder that cannot be loaded.

        """
        from petl.run import load

        tasks = {str(k): v for k, v in runs.items()} if isinstance(runs, Mapping) else {str(r): r for r in runs}
        if not tasks:
            raise ValueError("MultiTask.from_runs needs at least one run folder")
        cards = {name: load.read_card(path) for name, path in tasks.items()}
        first, *others = cards
        for name in others:
            difference = load.backbone_difference(cards[first]["backbone"], cards[name]["backbone"])
            if difference:
                raise ValueError(
                    f"run {name} was trained on another backbone than run {first} ({difference}): "
                    "serve it with a MultiTask of its own"
                )
        return cls(load.create_backbone(cards[first]["backbone"]), tasks)

    @classmethod
    def _load_run(cls, name: str, folder: Path, card: dict[str, Any], backbone: nn.Module) -> nn.Module:
        """A run folder's model on ``backbone``, once its card says the backbone is the one the run trained on."""
        from petl.run import load

        mismatch = load.backbone_mismatch(card, backbone)
        if mismatch is None:
            model = cls._load(name, load.weights_file(folder, card), backbone)
            mismatch = load.frozen_mismatch(card, model)
            if mismatch is None and vit.num_classes(model) != card["num_classes"]:
                mismatch = f"its weights hold {vit.num_classes(model)} classes, its card {card['num_classes']}"
        if mismatch is not None:
            raise TaskRefused(name, f"task {name!r} cannot be served over this backbone: {mismatch}")
        return model

    @staticmethod
    def _load(name: str, path: Path, backbone: nn.Module) -> nn.Module:
        """The task's single-task model: the backbone's frozen tensors shared, the file's tensors its own."""
        model = _shared_copy(backbone, unshared=_trained_backbone_tensors(backbone, path))
        load_trainable(model, path)
        return model.eval()

    def _route(self, backbone: nn.Module, hooks: list[dict[str, RowHook]]) -> nn.Module:
        """A copy of the backbone (frozen tensors shared) with a routed module wherever some task has a hook."""
        routed = _shared_copy(backbone)
        by_path: dict[str, dict[int, RowHook]] = {}
        for task, sites in enumerate(hooks):
            for path, hook in sites.items():
                by_path.setdefault(path, {})[task] = hook
        blocks = set(_block_paths(backbone))
        # Innermost first: a block is routed around its already-routed Linears.
        for path in sorted(by_path, key=lambda p: p.count("."), reverse=True):
            parent_path, _, name = path.rpartition(".")
            parent = routed.get_submodule(parent_path)
            kind = RoutedBlock if path in blocks else RoutedModule
            try:
                module = kind(getattr(parent, name), by_path[path], self._router)
            except CannotShare as error:
                task = self.names[min(by_path[path])]
                raise TaskRefused(task, f"task {task!r} cannot share the backbone at {path}: {error}") from None
            setattr(parent, name, module)
        return routed

    def train(self, mode: bool = True) -> MultiTask:
        """Only eval mode: a MultiTask serves trained tasks (train each task with ``petl-run``)."""
        if mode:
            raise ValueError("MultiTask serves trained tasks and stays in eval mode; train each task on its own")
        return super().train(False)

    def task_index(self, task_ids: Sequence[str] | Sequence[int] | Tensor, rows: int) -> Tensor:
        """``task_ids`` (names, or indices into :attr:`names`) as a CPU tensor of task indices, checked."""
        if isinstance(task_ids, Tensor):
            index = task_ids.detach().to("cpu", torch.long).reshape(-1)
        else:
            lookup = {name: i for i, name in enumerate(self.names)}
            try:
                index = torch.tensor([lookup[t] if isinstance(t, str) else int(t) for t in task_ids], dtype=torch.long)
            except KeyError as error:
                raise ValueError(f"unknown task {error.args[0]!r}; the tasks are {', '.join(self.names)}") from None
        if len(index) != rows:
            raise ValueError(f"{len(index)} task ids for {rows} images: give one task per image")
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= len(self.names)):
            raise ValueError(f"task index out of range: there are {len(self.names)} tasks")
        return index

    @staticmethod
    def _slot_mask(x: Tensor, groups: list[tuple[int, int, int]], tokens: Tokens, used: list[int]) -> Tensor:
        """Rows x tokens, True except at each row's slots past ``used[task]`` (its task's slots in use)."""
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        slot = torch.arange(tokens.slots, device=x.device)
        for task, first, end in groups:
            mask[first:end, tokens.prefix : tokens.prefix + tokens.slots] = slot < used[task]
        return mask

    def forward(self, images: Tensor, task_ids: Sequence[str] | Sequence[int] | Tensor) -> Tensor:
        """Each image's logits from its own task.

        Args:
            images: a batch (N x 3 x H x W), preprocessed as the backbone expects.
            task_ids: one task per image: names, or indices into :attr:`names`.

        Returns:
            N x C logits, C the largest class count among the tasks; a row's columns beyond its own task's
            classes are ``-inf`` (so softmax and argmax ignore them).

        """
        index = self.task_index(task_ids, images.shape[0])
        order = torch.argsort(index, stable=True)
        counts = torch.bincount(index, minlength=len(self.names)).tolist()
        groups, start = [], 0
        for task, count in enumerate(counts):
            if count:
                groups.append((task, start, start + count))
                start += count
        prefix = vit.num_prefix_tokens(self.backbone)
        tokens = Tokens(prefix, max((self.prompts[t] for t, _, _ in groups), default=0))
        self._router.batch = _Batch(groups, tokens)
        try:
            x = vit.embed_tokens(self.backbone, images[order.to(images.device)])
            pool = None
            if tokens.slots:
                x = tokens.with_slots(x)
                # Each row pools (and, per block, attends) only the slots its own task fills.
                pooled = [n if p else 0 for n, p in zip(self.prompts, self.pool_prompts, strict=True)]
                pool = self._slot_mask(x, groups, tokens, pooled)
            masks: dict[tuple[int, ...], Tensor] = {}
            for i, block in enumerate(vit.block_container(self.backbone)):
                if not tokens.slots:
                    x = block(x)
                    continue
                visible = tuple(self.visible[task][i] for task, _, _ in groups)
                if visible not in masks:
                    masks[visible] = self._slot_mask(x, groups, tokens, [v[i] for v in self.visible])[:, None, None]
                x = block(x, attn_mask=masks[visible])
            features = vit.pooled_features(self.backbone, x, pool)
        finally:
            self._router.batch = None
        width = max(self.num_classes.values()) or features.shape[-1]
        parts = []
        for task, first, end in groups:
            logits = vit.head(self.tasks[task])(features[first:end])
            parts.append(nn.functional.pad(logits, (0, width - logits.shape[-1]), value=float("-inf")))
        out = torch.empty(images.shape[0], width, dtype=features.dtype, device=features.device)
        if parts:
            out[order.to(out.device)] = torch.cat(parts)
        return out
