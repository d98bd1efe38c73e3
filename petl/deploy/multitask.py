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
token sits); a task whose prompts change from block to block (NOAH) gives each block's count.  Where a
family's attention adds position terms to the patch tokens (a relpos ViT's or BEiT's relative-position bias,
EVA's rotary embedding), the shared blocks give the slots none, as each task's own model gives its extra tokens
none.  Where launching ops is what a batch costs (a GPU: :attr:`MultiTask.launch_bound`) every row goes through
the blocks in that one pass, a task without prompts having all its slots masked; where the arithmetic is (a CPU)
the rows of tasks without prompts take a pass of their own, without slots or masks, and the prompted tasks' rows
a second.  On a Swin, VPT's prompts travel beside the grid, where no slot holds them (``RowHook.beside``): the rows
of VPT tasks take a pass per prompt count through the shared frozen Swin's plain modules, each row with its own
task's prompts gathered at every block (:class:`PromptsBeside`, ``Backbone.features_with_prompts``).

Tasks whose hooks at a module have the same batched form (:class:`petl.model.rows.Batched`: LoRA's and FacT's
low-rank updates of any rank, SSF's scale and shift with BitFit's bias deltas, bottleneck adapters of one style, VPT
prompts of one count, Convpass's bypasses) do not loop: their tensors are stacked once, when the MultiTask is built
(smaller ranks and bottlenecks zero-padded), and when two or more of them are in a batch, one batched op updates the
span of rows from the first of them to the last with each row's own task's entry (each row's LoRA A and B, then two
``bmm``, as Punica's BGMV and S-LoRA serve many adapters; one ``addcmul`` for the span's scales and shifts), the
rows there of other tasks taking a neutral entry that leaves them exactly as they are (on a CPU only when the
stacked tasks hold half the span's rows: see :attr:`MultiTask.launch_bound`).  The span's entries of all the stacks
of one set of tasks are gathered in one op per batch
(:class:`petl.deploy.routing.StackTables`).  Linear heads are stacked the same way (one batched matmul for every
row's logits).  A hook without a batched form, or one task's form alone in the batch, acts on its own rows as
above; served without autograd, a hook that can (``RowHook.post_in_place``) adds its update into its rows of the
frozen module's fresh output in place, so a task costs its own ops and no copy of its rows back into the batch.
On a GPU such a batch is bound by the host launching ops, which ``tests/deploy`` counts; there :meth:`MultiTask.forward`
captures a batch layout (the rows of each task, in any order) that repeats as a CUDA graph and replays it with one
launch (:attr:`MultiTask.graphs`, :mod:`petl.deploy.graphs`); where every hook stacks (:attr:`MultiTask.every_row`),
one graph per batch size answers every mix of tasks.

A method opts in next to its wrapper: ``@register_row_hook(MyWrapper)`` on a function that says what
the wrapper does to its rows, and optionally its batched form (see ``petl/methods/lora.py``).  A task
whose model holds a module no hook covers (a peft tuner other than LoRA, DoRA or IA3), or trains a frozen
weight matrix that every row's matmul shares (Partial-k, full fine-tuning), is refused with one line naming its method.
Inference only: the tasks are in eval mode.
"""

from __future__ import annotations

import copy
import numbers
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from petl.deploy.graphs import LayoutGraph, LayoutGraphs, capture, storage_of
from petl.deploy.routing import Batch, RoutedBlock, RoutedModule, Router, check_images, method_name, task_sites
from petl.deploy.tasks import check_task_names, named_runs
from petl.model.backbone import Backbone, backbone_of, naflexvit
from petl.model.io import OtherFrozenWeights, load_trainable, meta_copy, read_header, read_trainable_metadata
from petl.model.params import trainable_state
from petl.model.rows import CannotShare, RowHook, Tokens, rows_matmul
from petl.model.surgery import apply
from petl.store import files, run_card

Tensor = torch.Tensor


class TaskRefused(ValueError):
    """:class:`MultiTask` refuses a task: ``task`` names it, the one-line message says why; ``mismatch``: the
    run did not train on this backbone (its architecture, size or frozen tensors), not a method that cannot share it.

    A caller serving many runs (``petl-predict``) can serve the others together and this one on its own.
    """

    def __init__(self, task: str, message: str, mismatch: bool = False) -> None:
        super().__init__(message)
        self.task, self.mismatch = task, mismatch


def _weights_file(path: str | Path) -> Path:
    """A task's weights: the file itself, or ``trainable.safetensors`` inside a run folder."""
    path = Path(path)
    return path / files.WEIGHTS_FILE if path.is_dir() else path


def _run_card(path: str | Path) -> dict[str, Any] | None:
    """A folder's checked card (:func:`petl.store.run_card.read_card`, which names a folder that is no run, a timm
    folder petl-export wrote), or ``None`` for a weights file or a folder holding one without a card.
    """
    path = Path(path)
    card = (path / run_card.MODEL_FILE).is_file() or not (path / files.WEIGHTS_FILE).is_file()
    return run_card.read_card(path) if path.is_dir() and card else None


def _trained_backbone_tensors(task: str, backbone: nn.Module, path: Path) -> set[str]:
    """The names of the backbone's tensors that the method in ``path`` trains, wherever it moves them.

    BitFit's biases keep their backbone names in the file, but GPS trains the biases of the layers it wraps
    (``blocks.0.attn.qkv.base.bias``) and HST the LayerNorms of the blocks it wraps: the method is built on a
    meta-device copy of the backbone (nothing allocated) and its trained tensors are matched to the backbone's
    by identity, so that loading never writes into a tensor the tasks share: a file that also holds backbone
    tensors trained beside the method (a norm the caller unfroze) is refused (:class:`TaskRefused`).
    """
    meta = read_trainable_metadata(path)
    shadow = meta_copy(backbone)
    names = {id(t): n for n, t in [*shadow.named_parameters(), *shadow.named_buffers()]}
    try:
        applied = apply(shadow, meta["method"], **meta["config"])
    except (ValueError, TypeError) as error:  # as load_trainable words it
        raise ValueError(f"{path}: cannot apply its method {meta['method']!r}: {error}") from None
    trained = trainable_state(applied)
    beside = sorted(read_header(path).keys() - trained.keys())
    if beside:
        # load_trainable would write them into the frozen tensors every task (and the caller's backbone) shares, and
        # no routed hook would read them as the task's own.
        why = f"{path} holds backbone tensors trained beside its method ({', '.join(beside[:3])}), shared frozen"
        use = "use its own model (petl.load_trainable)"
        raise TaskRefused(task, f"task {task!r} cannot share the backbone: {why}; {use}")
    objects = {**dict(applied.named_parameters()), **dict(applied.named_buffers())}
    return {names[id(objects[n])] for n in trained if id(objects.get(n)) in names}


def _shared_copy(backbone: nn.Module, unshared: set[str] = frozenset()) -> nn.Module:
    """A copy of ``backbone`` whose parameters and buffers are the backbone's own objects, except ``unshared``."""
    tensors = [*backbone.named_parameters(), *backbone.named_buffers()]
    memo = {id(t): t for name, t in tensors if name not in unshared}
    return copy.deepcopy(backbone, memo)


def _to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """``tensor``, built on the CPU, on ``device``, the copy queued without waiting for the GPU.

    A plain ``.to()`` from the CPU's pageable memory returns only once the GPU has run every op queued before it: in
    a forward whose first ops are queued, the host, which launches the ops, would idle until the GPU drains.  From
    the CPU to a GPU ``non_blocking=True`` is safe with pageable memory: CUDA copies it to a staging buffer before
    the call returns (PyTorch's tutorial "A guide on good usage of non_blocking and pin_memory()").
    """
    return tensor.to(device, non_blocking=True)


class _ServedDropout(nn.Identity):
    """A served copy's dropout: its input as it is, as an eval-mode ``nn.Dropout`` gives it, without the op that
    ``nn.Dropout`` still dispatches to give it (38 per call of a ViT-B).  A MultiTask stays in eval mode.
    ``p`` is kept for code that reads it (timm's fused attention, when training).
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p


def _without_dropout(model: nn.Module) -> None:
    """Every ``nn.Dropout`` in ``model`` (a served copy, eval only) replaced by a :class:`_ServedDropout`."""
    for name, module in list(model.named_modules()):
        if type(module) is nn.Dropout:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, _ServedDropout(module.p))


def _block_paths(backbone: nn.Module) -> list[str]:
    """The module paths of the backbone's blocks, in order."""
    paths = {id(m): path for path, m in backbone.named_modules()}
    return [paths[id(b)] for b in backbone_of(backbone).block_container()]


def _graph_rows(rows: int) -> int:
    """The rows of the graph that answers a batch of ``rows`` whose tasks run every row: the next power of two up to
    64, the next multiple of 64 past it.  Seven graph sizes answer every batch of 1 to 64 rows; where a GPU is bound
    by the host launching ops (a small batch), the padding's rows cost little, and past 64 rows, where its arithmetic
    starts to count, the padding is at most 63 rows.
    """
    return 1 << (rows - 1).bit_length() if rows <= 64 else -(-rows // 64) * 64


def _may_replay(images: Tensor) -> bool:
    """Whether :meth:`MultiTask.forward` may answer ``images`` from a CUDA graph: on a GPU, without autograd."""
    return images.device.type == "cuda" and not torch.is_grad_enabled()


class PromptsBeside(nn.Module):
    """The prompts of tasks whose prompts travel beside the tokens (VPT's on a Swin), all of one count, for one pass
    of their rows through the plain backbone, each row with its own task's prompts.

    Per block, every task's own prompts there are stacked once (task index x count x width; zeros, unused, for a
    task that carries its prompts there or is not one of them), so that a pass gathers each row's in one op.

    Args:
        sites: task index -> its hooks (every one ``beside``).
        blocks: the backbone's block paths, in order.
        tasks: how many tasks the MultiTask serves.
        bb: the backbone (for its pooling).

    Raises:
        CannotShare: tasks that differ in what the pooling sees, on a backbone whose pooling cannot leave tokens out.

    """

    def __init__(self, sites: dict[int, dict[str, RowHook]], blocks: list[str], tasks: int, bb: Backbone) -> None:
        super().__init__()
        self.at: list[bool] = []
        for i, path in enumerate(blocks):
            own = {task: s[path].own_prompts for task, s in sites.items() if path in s}
            own = {task: p for task, p in own.items() if p is not None}
            self.at.append(bool(own))
            if not own:
                continue
            first = next(iter(own.values()))
            table, use = first.new_zeros(tasks, *first.shape), torch.zeros(tasks, dtype=torch.bool)
            for task, prompt in own.items():
                table[task], use[task] = prompt, True
            self.register_buffer(f"prompts_{i}", table, persistent=False)
            # Every task of the pass puts its own here: no row carries, nothing to choose.
            self.register_buffer(f"use_{i}", None if len(own) == len(sites) else use, persistent=False)
        pools = {task: all(hook.pool_prompts for hook in s.values()) for task, s in sites.items()}
        self.pool_prompts: bool | None = next(iter(pools.values())) if len(set(pools.values())) == 1 else None
        if self.pool_prompts is None and bb.pool_type() not in bb.maskable_pools:
            raise CannotShare(
                f"its prompts' pooling differs from another task's, which the backbone's {bb.pool_type()!r} pooling "
                f"cannot tell apart (only {', '.join(bb.maskable_pools)})"
            )
        pool = torch.zeros(tasks, dtype=torch.bool)
        pool[[task for task, p in pools.items() if p]] = True
        self.register_buffer("pool", pool, persistent=False)

    def forward(self, plain: nn.Module, tokens: Tensor, rows: Tensor) -> Tensor:
        """The pooled features of embedded ``tokens`` through ``plain`` (the plain backbone), ``rows``: each row's
        task index (on ``tokens``' device).
        """
        prompts = []
        for i, at in enumerate(self.at):
            if not at:  # every row carries its prompts through this block
                prompts.append(None)
                continue
            use = getattr(self, f"use_{i}")
            prompts.append((getattr(self, f"prompts_{i}")[rows], None if use is None else use[rows]))
        pool = self.pool[rows] if self.pool_prompts is None else self.pool_prompts
        return backbone_of(plain).features_with_prompts(tokens, prompts, pool)


@dataclass
class _Layout:
    """How one batch's rows are routed, worked out on the CPU from their task indices alone.

    Attributes:
        groups: (task, first row, end row) per task present, in the sorted rows' order.
        parts: the groups by pass through the blocks (0: rows without prompt slots, 1: rows with them, 2 and up:
            each pass of prompts beside the tokens).
        tasks: each sorted row's task index, on the CPU.
        rows: the same on the images' device.
        order: the batch's row index of each sorted row, on the images' device.
        launch: whether the stacks act as where launching ops is the cost (:attr:`MultiTask.launch_bound`).
        every_row: whether every stack acts on every row (:class:`petl.deploy.routing.Batch`): the ops then do not
            depend on the mix of tasks (:attr:`MultiTask.every_row`).

    """

    groups: list[tuple[int, int, int]]
    parts: dict[int, list[tuple[int, int, int]]]
    tasks: Tensor
    rows: Tensor
    order: Tensor
    launch: bool
    every_row: bool = False


class MultiTask(nn.Module):
    """Several tasks' trained PETL modules over one shared frozen ViT, serving batches of mixed tasks.

    Args:
        backbone: the plain timm ViT the tasks were trained on (no petl method applied); its parameters are
            shared by every task, never copied (and are set not to require grad).
        tasks: task name (a string) -> a ``.safetensors`` file from :func:`petl.save_trainable` or a ``petl-run`` run
            folder holding ``trainable.safetensors`` (checked against ``backbone`` by its ``model.json``).  Any mix
            of methods that can share (see the module doc).

    Attributes:
        launch_bound: whether launching ops is what a batch costs (a GPU: stacked hooks act whenever two of their
            tasks are in it) or the arithmetic is (a CPU: only when their tasks hold half the rows of their span, since
            their op computes every row there); ``None`` (the default): by the batch's device, any but the CPU.
        graphs: the CUDA graphs :meth:`forward` replays (:class:`petl.deploy.graphs.LayoutGraphs`): on a GPU and
            without autograd, a layout (the rows of each task, whatever their order) that comes a second time is
            captured and every later batch of it replayed with one launch, 8 layouts at most (the most used);
            ``graphs.size = 0`` runs every batch eagerly (and drops the graphs kept).
        every_row: whether every task's every hook stacks (one task's batched form too) and every head is a Linear
            (LoRA, FacT, SSF, BitFit, adapters, VPT, Convpass): then the graphs' batches run every row through every
            stack, the neutral entry for the rows of other tasks, with slots for every task's prompts and each row's
            masks gathered from its task's, so that one graph per batch size answers every mix of tasks (as vLLM's
            LoRA batches are captured with each row's adapter as data), a batch padded for it to the next power of
            two rows (past 64, the next multiple of 64).

    Raises:
        ValueError: ``tasks`` not a mapping, a task named by an integer (forward reads integers as indices), a
            file that does not load onto ``backbone`` (the message names it), a task that cannot share the backbone
            (the message names the task and its method), or a run or file trained on another backbone
            (:class:`TaskRefused`, naming the task and the difference).
        TypeError: on ``copy.deepcopy``, ``copy.copy`` or pickling (``torch.save``) of a MultiTask: its tasks' hooks
            read its own modules, which a copy would not rebind; build another from the same backbone and files.

    """

    launch_bound: bool | None = None

    def __init__(self, backbone: nn.Module, tasks: Mapping[str, str | Path]) -> None:
        super().__init__()
        self.graphs = LayoutGraphs()
        self._serving = threading.RLock()  # one forward at a time: another thread would replace its Router.batch
        # The prompt slots' masks of every task, per device, dtype and token layout (_row_mask).
        self._mask_tables: dict[tuple[Any, ...], Tensor] = {}
        if getattr(backbone, "petl_method", None) is not None:
            raise ValueError(f"pass the plain backbone: this one carries petl method {backbone.petl_method!r}")
        bb = backbone_of(backbone)
        bb.check()
        if not isinstance(tasks, Mapping):  # a list would fail on .items() below, without saying what to pass
            raise ValueError(
                f"MultiTask takes tasks as task name -> weights file or run folder, got a {type(tasks).__name__}: "
                "e.g. MultiTask(backbone, {'cifar': 'runs/cifar'}), or MultiTask.from_runs([...]) for run folders"
            )
        if not tasks:
            raise ValueError("MultiTask needs at least one task")
        check_task_names(tasks)
        backbone.requires_grad_(False).eval()
        self.names = [str(name) for name in tasks]
        # What timm's patch embedding takes: its channels, and its image size where it holds to one (or a shape error:
        # check_images says it in one line), or a NaFlexEva's rotation (block_inputs': the model's grid, timm's: any).
        embed = getattr(backbone, "patch_embed", None)
        proj = getattr(embed, "proj", None)
        # A hybrid ViT's (timm's HybridEmbed) proj takes its CNN's features: the images' channels are its in_chans.
        channels = getattr(embed, "in_chans", None)
        self._channels = channels if channels is not None else proj.in_channels if isinstance(proj, nn.Conv2d) else None
        size = getattr(embed, "img_size", None)  # timm turns strict_img_size off where the size is dynamic
        strict = getattr(embed, "strict_img_size", False) and isinstance(size, tuple | list)
        roped = isinstance(bb, naflexvit.NaFlexEva) and backbone.rope is not None
        self._image_size = tuple(size) if strict else bb.image_size() if roped else None
        models, hooks, rooms = [], [], False
        besides: dict[int, dict[str, RowHook]] = {}
        for name, path in tasks.items():
            card = _run_card(path)
            if card is None:  # a weights file alone: nothing records its backbone
                model = self._load(name, _weights_file(path), backbone)
            else:
                model = self._load_run(str(name), Path(path), card, backbone)
            try:
                sites = task_sites(model, backbone)
            except CannotShare as error:
                method = method_name(model)
                raise TaskRefused(name, f"task {name!r} (method {method}) cannot share the backbone: {error}") from None
            models.append(model)
            if any(hook.beside for hook in sites.values()):
                # Prompts beside the tokens (VPT's on a Swin): the task's rows take a pass of their own (_beside).
                besides[len(hooks)] = sites
                routed = [path for path, hook in sites.items() if not hook.beside]
                if routed:
                    raise TaskRefused(
                        name,
                        f"task {name!r} (method {method_name(model)}) cannot share the backbone: its prompts travel "
                        f"beside the tokens, in a pass of their own through the frozen backbone, which its hook at "
                        f"{routed[0]} would not act in",
                    )
                sites = {}
            # A room wrapper acts on no rows: the shared blocks get room for the batch's slots instead (_make_room).
            hooks.append({path: hook for path, hook in sites.items() if not hook.room})
            rooms = rooms or len(hooks[-1]) < len(sites)
        # The task models own the trained tensors (so .to() moves them); their frozen tensors are the backbone's.
        self.tasks = nn.ModuleList(models)
        self.num_classes = {name: backbone_of(m).num_classes() for name, m in zip(self.names, models, strict=True)}
        self.prompts = [max((h.prompts for h in sites.values()), default=0) for sites in hooks]
        self.pool_prompts = [all(h.pool_prompts for h in sites.values()) for sites in hooks]
        # Per task, per block: how many of its slots the block's tokens attend (all, unless a block hook says).
        blocks = _block_paths(backbone)
        self.visible = [
            [n if sites.get(b) is None or sites[b].visible is None else sites[b].visible for b in blocks]
            for sites, n in zip(hooks, self.prompts, strict=True)
        ]
        # Every hook with a batched form, no pass of its own: every stack can act on every row (in slots for every
        # task's prompts), so that a batch's ops need not depend on its mix of tasks (every_row: one CUDA graph per
        # batch size).
        batched = all(
            hook.batched is not None
            for sites in hooks
            for hook in sites.values()
            if hook.pre or hook.post or hook.mid or hook.branch  # a hook that only says its prompt count acts on none
        )
        self._router = Router(len(self.names), every_row=batched and not besides)
        self.backbone = self._route(backbone, hooks)
        if rooms:
            self._make_room(self.backbone)
        self._router.tables.build()
        self.stack_tables = self._router.tables
        self.rank = self._stack_order()
        self._stack_heads([backbone_of(m).head() for m in models])
        self._beside(backbone, besides)
        routed = [m for m in self.backbone.modules() if isinstance(m, RoutedModule)]
        self.every_row = self._router.every_row and self.stacked_heads and all(m.every_row for m in routed)
        if any(self.prompts) and bb.pool_type() not in bb.maskable_pools:
            task = self.names[next(i for i, n in enumerate(self.prompts) if n)]
            raise TaskRefused(
                task,
                f"task {task!r} adds prompt tokens, which a mixed batch cannot leave out of the backbone's "
                f"{bb.pool_type()!r} pooling yet (only {', '.join(bb.maskable_pools)})",
            )
        self.eval()

    @classmethod
    def from_runs(cls, runs: Iterable[str | Path] | Mapping[str, str | Path]) -> MultiTask:
        """A MultiTask over the backbone the runs' cards (``model.json``) record, built once for all of them.

        Args:
            runs: ``petl-run`` folders (a list, or any iterable: ``Path("runs").glob("*")``; each named by its path), or
                task name (a string) -> folder.

        Raises:
            ValueError: runs trained on different backbones (the message names the run and the first difference),
                a folder that cannot be loaded, one path given where a list of them is taken, or one folder listed
                twice (a dict names two tasks of one run).

        """
        from petl.store import run_card

        tasks = named_runs(runs)
        cards = {name: run_card.read_card(path) for name, path in tasks.items()}
        first, *others = cards
        for name in others:
            difference = run_card.backbone_difference(cards[first]["backbone"], cards[name]["backbone"])
            if difference:
                raise ValueError(
                    f"run {name} was trained on another backbone than run {first} ({difference}): "
                    "serve it apart, with a MultiTask of its own or a second petl-serve on another port"
                )
        return cls(run_card.create_backbone(cards[first]["backbone"], Path(tasks[first]) / run_card.MODEL_FILE), tasks)

    @classmethod
    def _load_run(cls, name: str, folder: Path, card: dict[str, Any], backbone: nn.Module) -> nn.Module:
        """A run folder's model on ``backbone``, once its card says the backbone is the one the run trained on."""
        from petl.store import run_card

        mismatch = run_card.backbone_mismatch(card, backbone)
        if mismatch is None:
            checked = card["backbone"].get("frozen_sha256") is not None  # by frozen_mismatch, below
            model = cls._load(name, run_card.weights_file(folder, card), backbone, check_frozen=not checked)
            mismatch = run_card.frozen_mismatch(card, model)
            if mismatch is None and backbone_of(model).num_classes() != card["num_classes"]:
                mismatch = (
                    f"its weights hold {backbone_of(model).num_classes()} classes, its card {card['num_classes']}"
                )
        if mismatch is not None:
            raise TaskRefused(name, f"task {name!r} cannot be served over this backbone: {mismatch}", mismatch=True)
        return model

    @staticmethod
    def _load(name: str, path: Path, backbone: nn.Module, check_frozen: bool = True) -> nn.Module:
        """The task's single-task model: the backbone's frozen tensors shared, the file's tensors its own."""
        model = _shared_copy(backbone, unshared=_trained_backbone_tensors(name, backbone, path))
        try:
            load_trainable(model, path, check_frozen=check_frozen)
        except OtherFrozenWeights as error:  # its remedy, check_frozen=False, is load_trainable's: MultiTask has none
            served = "serve it over the backbone it was trained on, in the dtype it was saved in (cast the MultiTask)"
            why = f"task {name!r} cannot be served over this backbone: {error.why}: {served}"
            raise TaskRefused(name, why, mismatch=True) from None
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
        backbone_of(routed).adopt_wrapped_linears()
        _without_dropout(routed)
        return routed

    def _stack_order(self) -> list[int]:
        """Each task's place in the sorted batch: tasks that stack together (at any module) next to each other, so
        that a stack's rows are one span of the batch and its op runs over those rows alone.

        The tasks linked by shared stacks form groups (their connected components), in the order of each group's
        first task; within a group, by task index.
        """
        group = list(range(len(self.names)))  # union-find: each task's representative, the group's first task

        def find(task: int) -> int:
            while group[task] != task:
                task = group[task]
            return task

        for module in self.backbone.modules():
            for stack in module.stacks if isinstance(module, RoutedModule) else ():
                first = find(stack.tasks[0])
                for task in stack.tasks[1:]:
                    other = find(task)
                    group[max(first, other)] = first = min(first, other)
        order = sorted(range(len(self.names)), key=lambda task: (find(task), task))
        rank = [0] * len(order)
        for place, task in enumerate(order):
            rank[task] = place
        return rank

    @staticmethod
    def _make_room(routed: nn.Module) -> None:
        """Room in every shared block's attention for the batch's prompt slots, right after the prefix tokens.

        Where a family adds position terms inside attention (a relpos ViT's or BEiT's relative-position bias, EVA's
        rotary embedding), each prompted task's own model leaves them out for its prompts, VPT's after the prefix
        tokens, HST's meta tokens in front of them, NOAH's at the end (``Backbone.make_room``); a token without a
        position is attended alike wherever it sits, so the shared blocks leave them out for the slots, which hold
        those tokens.  (A ViT's tasks make no room: its blocks need none.)  Where a task routes the attention itself
        (Convpass), the room goes around the frozen attention, under the routed module.
        """
        bb = backbone_of(routed)
        at = bb.num_prefix_tokens()
        for block in bb.block_list():
            attn = bb.attention(block)
            routed_attn = attn if isinstance(attn, RoutedModule) else None
            if routed_attn is not None:
                bb.set_attention(block, routed_attn.base)
            bb.make_room(block, at)
            if routed_attn is not None:
                routed_attn.base = bb.attention(block)
                bb.set_attention(block, routed_attn)

    def _stack_heads(self, heads: list[nn.Module]) -> None:
        """Every task's Linear head in one stack (tasks x classes x width, the bias one more column; rows past a task's
        classes zero, their biases -inf), so that a mixed batch's logits are one gather and one batched matmul; no
        stack unless every head is a Linear.
        """
        self.stacked_heads = all(type(head) is nn.Linear for head in heads)
        if not self.stacked_heads:
            return
        width = max(head.out_features for head in heads)
        stack = torch.zeros(len(heads), width, heads[0].in_features + 1, dtype=heads[0].weight.dtype)
        stack[:, :, -1] = float("-inf")
        with torch.no_grad():
            for task, head in enumerate(heads):
                stack[task, : head.out_features, :-1] = head.weight
                stack[task, : head.out_features, -1] = 0.0 if head.bias is None else head.bias
        self.register_buffer("head_stack", stack, persistent=False)

    def _beside(self, backbone: nn.Module, besides: dict[int, dict[str, RowHook]]) -> None:
        """The passes of the tasks whose prompts travel beside the tokens (VPT on a Swin), one per prompt count,
        through a copy of the plain backbone whose modules are its frozen ones (nothing routed: no other task's hook
        acts there).
        """
        self.beside_pass = [-1] * len(self.names)  # each task's pass among self.beside, -1 for the routed ones
        by_count: dict[int, dict[int, dict[str, RowHook]]] = {}
        for task, sites in besides.items():
            by_count.setdefault(max(hook.prompts for hook in sites.values()), {})[task] = sites
        blocks = _block_paths(backbone)
        self.beside = nn.ModuleList()
        for count in sorted(by_count):
            group = by_count[count]
            for task in group:
                self.beside_pass[task] = len(self.beside)
            try:
                self.beside.append(PromptsBeside(group, blocks, len(self.names), backbone_of(backbone)))
            except CannotShare as error:
                task = self.names[min(group)]
                raise TaskRefused(task, f"task {task!r} cannot share the backbone: {error}") from None
        # A submodule, so that .to() moves it with the rest: its parameters and buffers are the backbone's objects,
        # and .to() replaces a buffer in each module that holds it.
        self.plain = _shared_copy(backbone) if besides else None
        if self.plain is not None:
            _without_dropout(self.plain)

    def _launch_bound(self, x: Tensor) -> bool:
        """:attr:`launch_bound`, or by ``x``'s device: any but the CPU."""
        return x.device.type != "cpu" if self.launch_bound is None else self.launch_bound

    def train(self, mode: bool = True) -> MultiTask:
        """Only eval mode: a MultiTask serves trained tasks (train each task with ``petl-run``)."""
        if mode:
            raise ValueError("MultiTask serves trained tasks and stays in eval mode; train each task on its own")
        return super().train(False)

    def task_index(self, task_ids: Sequence[str] | Sequence[int] | Tensor, rows: int) -> Tensor:
        """``task_ids`` (names, or indices into :attr:`names`) as a CPU tensor of task indices, checked."""
        # Integers only: a bool or a float (True, 1.7) is no task index, and turning it into one would route the row
        # to a task nobody named.
        if isinstance(task_ids, str | numbers.Integral):  # a string would be read as one task per letter
            raise ValueError(f"task_ids={task_ids!r} is one task: give one per image, e.g. [{task_ids!r}] * {rows}")
        if getattr(task_ids, "ndim", 1) != 1:  # an N x 1 tensor was flattened, a 2 x N one read as 2N rows
            raise ValueError(f"task ids are {tuple(task_ids.shape)}: give one task per image, a list or a 1-D array")
        if isinstance(task_ids, Tensor):
            if task_ids.dtype == torch.bool or task_ids.is_floating_point() or task_ids.is_complex():
                raise ValueError(f"task ids are a {task_ids.dtype} tensor: give task names or integer indices")
            index = task_ids.detach().to("cpu", torch.long)
        else:
            lookup = {name: i for i, name in enumerate(self.names)}
            kinds = (str, numbers.Integral)
            wrong = next((t for t in task_ids if isinstance(t, bool) or not isinstance(t, kinds)), None)
            if wrong is not None:
                raise ValueError(f"task id {wrong!r} is a {type(wrong).__name__}: give task names or integer indices")
            try:
                index = torch.tensor([lookup[t] if isinstance(t, str) else int(t) for t in task_ids], dtype=torch.long)
            except KeyError as error:
                raise ValueError(f"unknown task {error.args[0]!r}; the tasks are {', '.join(self.names)}") from None
        if len(index) != rows:
            raise ValueError(f"{len(index)} task ids for {rows} images: give one task per image")
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= len(self.names)):
            raise ValueError(f"task index out of range: there are {len(self.names)} tasks")
        return index

    def _row_mask(self, x: Tensor, rows: Tensor, tokens: Tokens, used: Sequence[int], additive: bool) -> Tensor:
        """Each row's mask over ``x``'s tokens (rows x tokens), leaving out its slots past ``used[task]``: True where
        it keeps a token, or (``additive``) 0 there and -inf elsewhere, as rows x 1 x 1 x tokens (SDPA's meaning of a
        float mask, which timm's non-fused attention takes too: a bool mask would be turned into one in every
        block's attention, three ops each).

        One gather by ``rows`` (each row's task index, on ``x``'s device) from a table of every task's mask, made on
        the CPU once per device, dtype and token layout and kept (:attr:`_mask_tables`): a batch's masks then depend
        on its rows' task indices alone, on the device, as a CUDA graph that answers every mix of tasks replays them
        (each batch's indices copied in), and the host builds and moves nothing.  An additive mask's rows are padded
        to a multiple of 8 tokens in its storage: the GPU's memory-efficient attention (the SDPA kernel that takes a
        mask) would otherwise pad an unaligned mask in every block (torch's
        aten/src/ATen/native/transformers/attention.cpp, preprocess_mask).
        """
        n = x.shape[1]
        key = (tuple(used), tokens, n, x.dtype if additive else torch.bool, x.device)
        table = self._mask_tables.get(key)
        if table is None:
            keep = torch.ones(len(used), n, dtype=torch.bool)
            used_by_task = torch.tensor(used, dtype=torch.long)
            keep[:, tokens.prefix : tokens.prefix + tokens.slots] = torch.arange(tokens.slots) < used_by_task[:, None]
            if additive:
                bias = torch.zeros(len(used), 1, 1, -(-n // 8) * 8, dtype=x.dtype)
                bias[..., :n].masked_fill_(~keep[:, None, None], float("-inf"))
                keep = bias  # moved whole: a slice would be moved as a tensor of its own, without the padding
            table = self._mask_tables[key] = _to_device(keep, x.device)
        gathered = table.index_select(0, rows)
        return gathered if gathered.shape[-1] == n else gathered[..., :n]

    def _features(self, x: Tensor, layout: _Layout, part: list[tuple[int, int, int]]) -> Tensor:
        """The pooled features of ``x``, the embedded rows of one of ``layout``'s parts (its groups: ``part``),
        through the routed blocks, each task's hooks on its own rows.
        """
        first, end = part[0][1], part[-1][2]
        groups = [(task, start - first, stop - first) for task, start, stop in part]
        rows = layout.rows[first:end]
        bb = backbone_of(self.backbone)
        # Run every row, the batch has slots for every task's prompts, whichever tasks it holds (its ops then do
        # not depend on them); otherwise for its own tasks' longest prompt set.
        present = range(len(self.names)) if layout.every_row else [task for task, _, _ in groups]
        tokens = Tokens(bb.num_prefix_tokens(), max((self.prompts[t] for t in present), default=0))
        self._router.batch = Batch(groups, tokens, rows, layout.launch, layout.every_row)
        try:
            pool = None
            if tokens.slots:
                x = tokens.with_slots(x)
            if tokens.slots and bb.pool_type() != "token":  # the class token alone: no slot to leave out
                # Each row pools (and, per block, attends) only the slots its own task fills.
                pooled = [n if p else 0 for n, p in zip(self.prompts, self.pool_prompts, strict=True)]
                pool = self._row_mask(x, rows, tokens, pooled, additive=False)
            # Once a forward, as timm's forward_features computes them (a shared bias padded for the slots once).
            inputs = bb.block_inputs(room=(tokens.prefix, tokens.slots) if tokens.slots else None)
            masks: dict[tuple[int, ...], Tensor] = {}
            for i, block in enumerate(bb.block_container()):
                x = bb.before_block(i, x)  # a Swin's patch merging in front of a stage's first block
                if not tokens.slots:
                    # With EVA's rope (a per-block one's row i) or a shared bias, as timm passes them.
                    x = bb.run_block(block, x, inputs=inputs, index=i)
                    continue
                visible = tuple(v[i] for v in self.visible)
                if visible not in masks:  # one per distinct set of slots the blocks attend (often one)
                    masks[visible] = self._row_mask(x, rows, tokens, visible, additive=True)
                x = bb.run_block(block, x, attn_mask=masks[visible], inputs=inputs, index=i)
            return bb.pooled_features(x, pool)
        finally:
            self._router.batch = None

    def forward(self, images: Tensor, task_ids: Sequence[str] | Sequence[int] | Tensor) -> Tensor:
        """Each image's logits from its own task.

        Args:
            images: a batch (N x 3 x H x W), preprocessed as the backbone expects, of its weights' dtype (float32
                unless the MultiTask was cast; under autocast any floating dtype); uint8 pixels are refused.
            task_ids: one task per image: names, or integer indices into :attr:`names` (a list, a 1-D NumPy array or
                integer tensor of N; a bool or a float is refused, and so is one name or index alone: ``[name] * N``,
                and an N x 1 column).

        Returns:
            N x C logits, C the largest class count among the tasks; a row's columns beyond its own task's
            classes are ``-inf`` (so softmax and argmax ignore them).

        """
        check_images(images, self._channels, self._image_size, next(self.backbone.parameters()).dtype)
        index = self.task_index(task_ids, images.shape[0])
        if not len(index):  # no rows, no task to route: 0 x C, as a timm model answers an empty batch
            width = max(self.num_classes.values()) or backbone_of(self.backbone).num_features()
            return images.new_empty(0, width)
        with self._serving:
            replay = _may_replay(images) and self.graphs.size > 0
            layout, logits = None, None
            if replay and self.every_row:  # every row through every stack: a graph answers every mix of tasks
                logits = self._replay_every_row(images, index)
            elif replay:  # a graph per layout: the rows of each task, in any order
                layout = self._layout(index, images)
                mix = tuple(torch.bincount(index, minlength=len(self.names)).tolist())
                logits = self.graphs.answer(
                    (mix, *self._graph_setting(images)), images, layout, lambda: self._capture(images, layout)
                )
            if logits is not None:
                return logits
            # Eager: each task's hooks on its own rows, fewer ops where few tasks are in the batch.
            return self._run(images, self._layout(index, images) if layout is None else layout)

    def _replay_every_row(self, images: Tensor, index: Tensor) -> Tensor | None:
        """The logits of a batch of tasks that run every row, from the graph of its padded size, or None where no
        graph answers it (yet).

        The batch is padded with rows of zeros (task 0's) to :func:`_graph_rows` rows, so that a few graphs answer
        every size a server's batches take, as vLLM pads a batch to the next size it captured a graph of
        (``_get_graph_batch_size`` in vllm/worker/model_runner.py); the padding's logits are computed and dropped (a
        row's logits depend on that row alone).
        """
        rows = len(index)
        size = _graph_rows(rows)
        if size > rows:
            images = torch.cat([images, images.new_zeros(size - rows, *images.shape[1:])])
            index = torch.cat([index, index.new_zeros(size - rows)])
        layout = self._layout(index, images, every_row=True)
        key = ("every row", *self._graph_setting(images))
        logits = self.graphs.answer(key, images, layout, lambda: self._capture(images, layout))
        return None if logits is None else logits[:rows]

    def _graph_setting(self, images: Tensor) -> tuple[Any, ...]:
        """What a graph of a layout was captured for besides its rows: the images, the path, autocast and TF32."""
        device = images.device.type
        autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device)
        tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        return images.shape, images.dtype, images.device, self._launch_bound(images), autocast, tf32

    def _capture(self, images: Tensor, layout: _Layout) -> LayoutGraph:
        """``layout``'s forward as a CUDA graph, holding the weights and mask tables it reads (:class:`LayoutGraph`)."""
        graph = capture(self._run, images, layout, storage_of(self))
        # The tables its masks are gathered from, made in the warm-up if not before: a .to() drops them from here.
        graph.weights = (*graph.weights, *self._mask_tables.values())
        return graph

    def _apply(self, fn: Any, recurse: bool = True) -> MultiTask:
        # .to() and .cuda() give the weights new memory: a graph would go on reading the old.
        self.graphs.clear()
        self._mask_tables.clear()
        return super()._apply(fn, recurse)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.deepcopy, copy.copy and pickle (torch.save) all come here.  The tasks' row hooks are closures over this
        # MultiTask's own modules, which a copy would not rebind: its answers would follow the original's tensors
        # (and a .to() of the copy leave them behind); pickle cannot write a closure at all.
        raise TypeError(
            "a MultiTask cannot be copied or pickled (its tasks' hooks read its own modules): build another from the "
            "same backbone and files, petl.MultiTask(backbone, tasks) or petl.MultiTask.from_runs(runs)"
        )

    def graphed(self, images: Tensor, task_ids: Sequence[str] | Sequence[int] | Tensor) -> LayoutGraph:
        """This batch layout's forward as one CUDA graph: ``graph(images)`` answers as ``self(images, task_ids)``.

        On a GPU a mixed batch's many small ops are bound by the host launching them (:attr:`launch_bound`); a
        CUDA graph launches the whole forward at once (``torch.cuda.CUDAGraph``, as vLLM serves a fixed batch size).
        :meth:`forward` keeps graphs of the layouts that repeat itself (:attr:`graphs`); this one is the caller's to
        keep.  The graph is this layout's: the same task at each row, the same image shape and dtype, the MultiTask
        on its present device and dtype (after ``.to()`` it still answers with the tensors it captured: make
        another), under the autocast in force here.  Each call copies the images into the graph's input and returns
        a copy of its output.  Inference only, as the MultiTask.

        Args:
            images: an example batch on a CUDA device (its values are not kept).
            task_ids: one task per row, as :meth:`forward` takes them.

        Raises:
            ValueError: images not on a CUDA device; when called, images of another shape, dtype or device.

        """
        if images.device.type != "cuda":
            raise ValueError(f"MultiTask.graphed makes a CUDA graph: give images on a CUDA device, not {images.device}")
        check_images(images, self._channels, self._image_size, next(self.backbone.parameters()).dtype)
        index = self.task_index(task_ids, images.shape[0])
        with self._serving:
            return self._capture(images, self._layout(index, images))

    def _layout(self, index: Tensor, images: Tensor, every_row: bool = False) -> _Layout:
        """How the rows of a batch with these task indices are sorted and routed (see :class:`_Layout`)."""
        launch_bound = self._launch_bound(images)
        # Rows sorted by task.  Where the arithmetic is the cost (a CPU), the tasks without prompt tokens come first
        # and their rows share the blocks without slots or attention masks, the prompted tasks' rows carrying them in
        # a pass of their own.  Where launching ops is (a GPU), every row goes through the blocks in one pass: the
        # rows without prompts carry empty slots too, masked out of their attention and pooling, which costs a few
        # tokens' arithmetic instead of launching every block's ops a second time.
        # The rows of tasks whose prompts travel beside the tokens (VPT on a Swin) take a pass per prompt count after
        # those: through the plain backbone, each row with its own prompts (PromptsBeside).
        passes = [
            2 + beside if beside >= 0 else int(n > 0 and not (launch_bound or every_row))
            for n, beside in zip(self.prompts, self.beside_pass, strict=True)
        ]
        # Within a pass, tasks that stack together are next to each other (_stack_order).  A task's place, as a
        # gather of one small table; none where the places keep the tasks' order (the index sorts the same).
        place = [self.rank[task] + len(self.names) * passes[task] for task in range(len(self.names))]
        key = index if place == sorted(place) else torch.tensor(place)[index]
        order = torch.argsort(key, stable=True)
        tasks = index[order]
        counts = torch.bincount(index, minlength=len(self.names)).tolist()
        groups, start = [], 0
        for task in sorted(range(len(self.names)), key=lambda t: (passes[t], self.rank[t])):
            if counts[task]:
                groups.append((task, start, start + counts[task]))
                start += counts[task]
        parts: dict[int, list[tuple[int, int, int]]] = {}
        for group in groups:
            parts.setdefault(passes[group[0]], []).append(group)
        device = images.device
        rows, order = _to_device(tasks, device), _to_device(order, device)
        return _Layout(groups, parts, tasks, rows, order, launch_bound, every_row)

    def _run(self, images: Tensor, layout: _Layout) -> Tensor:
        """The logits of ``images`` routed as ``layout`` says: every op on the images' device, none on the CPU's."""
        bb = backbone_of(self.backbone)
        groups, rows = layout.groups, layout.rows
        self._router.batch = Batch(groups, Tokens(bb.num_prefix_tokens(), 0), rows, layout.launch, layout.every_row)
        try:
            x = bb.embed_tokens(images[layout.order])
        finally:
            self._router.batch = None
        features = []
        for kind, part in layout.parts.items():
            first, end = part[0][1], part[-1][2]
            if kind >= 2:
                features.append(self.beside[kind - 2](self.plain, x[first:end], rows[first:end]))
                continue
            features.append(self._features(x[first:end], layout, part))
        features = features[0] if len(features) == 1 else torch.cat(features)
        if self.stacked_heads and (len(groups) >= 2 or layout.every_row):
            # Each row's own head gathered from the stack: one batched matmul for the mixed batch.
            head = self.head_stack[rows]
            sorted_logits = rows_matmul(features, head[:, :, :-1], add=head[:, :, -1])
        else:
            width = max(self.num_classes.values()) or features.shape[-1]
            parts = []
            for task, first, end in groups:
                logits = backbone_of(self.tasks[task]).head()(features[first:end])
                parts.append(nn.functional.pad(logits, (0, width - logits.shape[-1]), value=float("-inf")))
            sorted_logits = torch.cat(parts) if parts else features.new_empty(0, width)
        out = torch.empty_like(sorted_logits)
        out[layout.order] = sorted_logits
        return out
