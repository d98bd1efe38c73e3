"""Feature caching: pay for the frozen front of the backbone once per run, not once per epoch.

When nothing up to block ``i`` trains or is wrapped, the tokens entering block ``i`` are a fixed
function of the image: there is no augmentation, and frozen modules run in eval mode (no dropout,
no drop-path).  So they are computed once and the rest of the network trains on them.  When the
whole trunk including the final norms and pooling is frozen (linear probe, MLP head) the cached
tensors are the pre-logits features and only the head runs per step.

The decision is read off the model (which parameters require grad, where :class:`PetlModule`
wrappers or hooks sit), never off the method name, so a new method is cached correctly without
telling this module about it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from petl.model import timm_api
from petl.model.backbone import backbone_of, family_of
from petl.model.wrappers import PetlModule
from petl.train.readers import image_size
from petl.utils.errors import ConfigError
from petl.utils.progress import progress_bar

log = logging.getLogger(__name__)

# Above this size (CPU memory) the cache would cost more than it saves; the run goes uncached.
MAX_CACHE_BYTES = 8 * 2**30


@dataclass(frozen=True)
class CachePlan:
    """What to cache for a model.

    Attributes:
        start: index of the first block that runs every step; ``depth`` when only the final norm
            and head run.  ``None`` with ``features`` means the cached tensors are pre-logits.
        features: cache pre-logits features and run only the head.

    """

    start: int | None
    features: bool

    def describe(self) -> str:
        """Short label recorded in result.json."""
        return "pre-logits features" if self.features else f"tokens entering block {self.start}"


def _untouched(module: nn.Module) -> bool:
    """No trainable parameter, no petl (or other) wrapper, no hook anywhere in ``module``."""
    for sub in module.modules():
        if isinstance(sub, PetlModule) or sub._forward_hooks or sub._forward_pre_hooks:
            return False
    return not any(p.requires_grad for p in module.parameters())


def _replaced(model: nn.Module, name: str) -> bool:
    """Whether ``model`` answers ``name`` with something else than its class's method, as far as the cache goes.

    petl's own ``forward_head`` (:func:`petl.model.timm_api.forward_head`) is the class's for everything the cached path
    replays: it only changes ``pre_logits=True`` under a method's own head, and calls the class's first.
    """
    own = vars(model).get(name)
    return own is not None and not (isinstance(own, functools.partial) and own.func is timm_api.forward_head)


# Why a run caches nothing, as the refusal of train.cache_features=false says it: plan() finds nothing frozen in
# front of what trains, the backbone runs in train mode, the training images are augmented.
NOTHING_FROZEN = "nothing in front of what the method trains is frozen"
BACKBONE_TRAINS = "train.backbone_mode is train, the frozen front is stochastic"
AUGMENTED = "the training images are augmented (a new crop and flip each epoch)"


class CacheOptionError(ConfigError):
    """``train.cache_features=false`` where the run caches nothing either way; ``reason`` says why.

    Its own class so that a sweep's check before it trains (:func:`petl.bench.sweep.check_configs`, petl-run's check
    of a ``--multirun``'s jobs) can gather every run that refuses it into one line, instead of stopping at the first.
    """

    def __init__(self, reason: str, method: str | None = None) -> None:
        said = f"method {method} caches nothing ({reason})" if method else reason
        super().__init__(
            f"train.cache_features=false cannot act: {said}, so no features are cached either way; drop it"
        )
        self.reason = reason


def plan(model: nn.Module) -> CachePlan | None:
    """The cache plan for ``model``, or ``None`` when nothing in front of the trained part is frozen.

    Only models that run their family's own forward are cached (:meth:`Backbone.is_plain`): the cached path
    replays that forward from the point it cuts in, which is only exact when the model runs those very methods
    (not a subclass's or a patched copy).
    """
    if family_of(model) is None:
        return None
    bb = backbone_of(model)
    overridden = any(_replaced(model, name) for name in ("forward", "forward_features", "forward_head"))
    if not bb.is_plain() or overridden or model._forward_hooks or model._forward_pre_hooks:
        return None
    # The stem: patch embedding, cls/register tokens, position embedding, norm_pre (and dropouts).
    stem_params, stem_modules = bb.stem()
    if any(p.requires_grad for p in stem_params) or not all(_untouched(m) for m in stem_modules):
        return None
    # A block's cut point is the module in front of it (itself, or a Swin's patch merging): both must be untouched.
    blocks = bb.block_container()
    start = next(
        (i for i, block in enumerate(blocks) if not (_untouched(block) and _untouched(bb.block_input_module(i)))),
        bb.depth(),
    )
    if start == 0:
        return None
    if start == bb.depth() and all(_untouched(m) for m in bb.after_blocks()):
        return CachePlan(start=None, features=True)
    return CachePlan(start=start, features=False)


def decide(
    model: nn.Module,
    *,
    backbone_trains: bool,
    augmented: bool,
    sizes: list[int],
    autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext,
) -> tuple[CachePlan | None, str | None]:
    """The features a run caches (:func:`plan`), or ``None`` and why none, as the run decides and its estimate too.

    Args:
        model: the backbone, its method applied, on the device the cache would be computed on.
        backbone_trains: whether the backbone runs in train mode (``train.backbone_mode``).
        augmented: whether the training images are augmented.
        sizes: the images of each split the cache would hold (:func:`fits`).
        autocast: the run's mixed precision (``accelerator.autocast``), under which :func:`cache_split` computes the
            cache: a cache over the limit in float32 is sized again in the dtype it would hold (:func:`cached_dtype`).

    """
    found = plan(model)
    if found is None:
        return None, NOTHING_FROZEN
    unsettled = uncached_by_settings(backbone_trains=backbone_trains, augmented=augmented)
    if unsettled is not None:
        return None, unsettled
    if not fits(model, found, sizes) and not fits(model, found, sizes, dtype := cached_dtype(model, found, autocast)):
        needed = cache_bytes(model, found, sum(sizes), dtype) / 2**30
        # The amount and the limit both: "would exceed 8 GiB" left the user to guess how far over a run was.
        return None, (
            f"the cache of {sum(sizes)} images would take {needed:.3g} GiB, over its limit of "
            f"{MAX_CACHE_BYTES / 2**30:.3g} GiB"
        )
    return found, None


def uncached_by_settings(*, backbone_trains: bool, augmented: bool) -> str | None:
    """Why the run's settings leave nothing to cache whatever the model (see :func:`decide`), else ``None``.

    Both are known from the config alone, so composing a config (:func:`petl.train.config.check_cache_option_acts`)
    refuses ``train.cache_features=false`` for them before any run starts.
    """
    if backbone_trains:
        # A cached front runs once in eval mode; with the backbone in train mode its dropout and drop-path must act
        # on every step, so nothing can be cached.
        return BACKBONE_TRAINS
    if augmented:
        # A cached image would be one random crop and flip reused every epoch: the augmentation would be lost.
        return AUGMENTED
    return None


class _Captured(Exception):
    """Raised by the capture hook to stop the forward once the cut point is reached."""


class CachedTail(nn.Module):
    """The part of ``model`` that runs on cached tensors.

    ``model`` is a child, so parameters, ``train()``/``eval()`` and the engine's
    ``set_train_mode`` see the same modules as on the full model; the forward skips the front.
    """

    def __init__(self, model: nn.Module, cache_plan: CachePlan) -> None:
        super().__init__()
        self.model = model
        self.plan = cache_plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from cached tensors (the rest of the model's forward from the cut point on)."""
        bb = backbone_of(self.model)
        if self.plan.features:
            # forward_head(pre_logits=True) ends with head_drop, which has no parameters and so
            # stays in eval mode (identity) on the uncached path too: only the head is left.
            return bb.head()(x)
        return bb.forward_from(x, self.plan.start)

    @torch.no_grad()
    def front(self, images: torch.Tensor) -> torch.Tensor:
        """What the cache holds for a batch of images (run with the model in eval mode)."""
        bb = backbone_of(self.model)
        if self.plan.features:
            return bb.pre_logits(images)
        cut = bb.block_input_module(self.plan.start)
        captured: list[torch.Tensor] = []

        def grab(_module: nn.Module, args: tuple) -> None:
            captured.append(args[0])
            raise _Captured

        handle = cut.register_forward_pre_hook(grab)
        try:
            self.model.forward_features(images)
        except _Captured:
            pass
        finally:
            handle.remove()
        return captured[0]


def cache_bytes(model: nn.Module, cache_plan: CachePlan, num_items: int, dtype: torch.dtype = torch.float32) -> int:
    """What :func:`cache_split` keeps for ``num_items`` images, in bytes, in tensors of ``dtype`` (the front's output:
    float32, or under mixed precision what :func:`cached_dtype` finds).

    Pre-logits features, or the tokens leaving the block in front of the cut (what
    :meth:`~petl.model.backbone.base.Backbone.block_input_module` receives): a Swin's cut in a later stage holds that
    stage's grid and width (or, at a stage's opening, the stage before's, in front of its PatchMerging), not the first
    stage's grid at the cut's width (twice the size at the second stage's opening, 64 times inside the fourth stage).
    """
    bb = backbone_of(model)
    if cache_plan.features:
        return num_items * bb.num_features() * dtype.itemsize
    leaving = cache_plan.start - 1  # plan() caches nothing in front of block 0
    return num_items * bb.block_tokens()[leaving] * bb.widths()[leaving] * dtype.itemsize


def fits(model: nn.Module, cache_plan: CachePlan, sizes: list[int], dtype: torch.dtype = torch.float32) -> bool:
    """Whether caching splits of these sizes in tensors of ``dtype`` stays under :data:`MAX_CACHE_BYTES`."""
    return cache_bytes(model, cache_plan, sum(sizes), dtype) <= MAX_CACHE_BYTES


@torch.no_grad()
def cached_dtype(
    model: nn.Module, cache_plan: CachePlan, autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext
) -> torch.dtype:
    """The dtype :func:`cache_split` would keep under ``autocast``: its front's output on one blank image.

    Mixed precision decides it per family and device, so it is read off a forward, not foreseen: a Swin's residual
    stream starts at its patch embedding's convolution, which CPU bf16 autocast leaves in bf16 (half float32's size);
    a ViT's is float32 from the position embedding's addition on, whatever its blocks' Linears return.
    """
    size = image_size(model)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with autocast():
            return CachedTail(model, cache_plan).front(torch.zeros(1, 3, size, size, device=device)).dtype
    finally:
        model.train(was_training)


@torch.no_grad()
def cache_split(
    tail: CachedTail,
    dataset: Dataset,
    accelerator: Accelerator,
    batch_size: int,
    num_workers: int = 0,
    progress: str | None = None,
) -> TensorDataset:
    """Run the frozen front over ``dataset`` once and keep (cached tensor, label) pairs in CPU memory.

    Every process computes the whole split (it is small: VTAB-1k), so each can shard it afterwards
    like any dataset.  Mixed precision applies as it would on the uncached path.  ``progress`` (the split's name)
    shows a progress bar, or logs a few ``caching train: 8/16 batches`` lines where no bar is drawn (a log file): a
    ViT-B's forward over a VTAB-1k split takes minutes on a CPU, before the first epoch's.
    """
    model = tail.model
    was_training = model.training
    model.eval()
    # Its own generator: drawing the worker seed from the global RNG would shift the stream that
    # dropout and drop-path use later, and the cached run would no longer match the uncached one.
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, generator=torch.Generator())
    outputs, labels = [], []
    bar = progress_bar(
        loader, desc=f"caching {progress}", unit="batch", leave=False, show=progress is not None, say=log.info
    )
    for images, targets in bar:
        with accelerator.autocast():
            outputs.append(tail.front(images.to(accelerator.device)).cpu())
        labels.append(torch.as_tensor(targets))
    model.train(was_training)
    return TensorDataset(torch.cat(outputs), torch.cat(labels))
