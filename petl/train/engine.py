"""The training engine: one loop on accelerate, shared by petl-run, petl-bench and petl-pretrain.

It knows nothing of methods: it trains whatever parameters require grad and reports top-1 accuracy.
Whether the frozen backbone's dropout and drop-path act during training is the one setting
``backbone_mode``: ``auto`` takes the default the method's config declares
(:attr:`petl.model.registry.MethodConfig.backbone_mode`, written down per method after its reference).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn
from torch.utils.data import DataLoader

from petl.data.registry import PROTOCOL_EPOCHS
from petl.model.wrappers import PetlModule
from petl.train.learning import prior_loss
from petl.train.options import check_options, option
from petl.utils.errors import ConfigError
from petl.utils.progress import progress_bar
from petl.utils.text import plural


class NonFiniteLossError(RuntimeError):
    """The training loss, or the trained weights, became NaN or infinite."""


BACKBONE_MODES = ("auto", "train", "eval")


@dataclass
class TrainSettings:
    """Optimisation settings (the field's VTAB-1k recipe as defaults).

    Attributes:
        epochs: passes over the training split.
        lr: peak learning rate of AdamW.
        weight_decay: AdamW weight decay.
        warmup_frac: fraction of the steps spent in linear warm-up before the cosine decay, rounded down to whole
            steps, the first at 1/steps of the lr; ``petl-run`` refuses one other than 0 and this default that is
            under two steps of its run (one runs at the full lr, as none does).
        label_smoothing: cross-entropy label smoothing, in [0, 1): the share of each target spread evenly over the
            classes.  1 is refused: every target would be uniform, the same whatever the label, so nothing is learned.
        grad_clip: max gradient norm, 0 to disable.
        backbone_mode: how the frozen backbone runs while training: ``train`` (dropout and
            drop-path act everywhere, as V-PETL, NOAH and PETL_Vision train), ``eval`` (only what
            learns is in train mode, as the VPT repo keeps its frozen encoder), or ``auto`` (the
            method's own default, :attr:`petl.model.registry.MethodConfig.backbone_mode`).  ``train`` and ``eval``
            on a backbone without any dropout, drop-path rate or BatchNorm, where they run alike, are refused
            (:func:`check_backbone_mode`): by ``petl-run`` before it builds anything, from Python when training
            starts.
        weight_decay_all: decay every trainable tensor; by default biases, norms (every 1-D
            tensor), prompt tokens and position embeddings are exempt, as in timm's
            ``param_groups_weight_decay`` and the models' ``no_weight_decay()``.  ``petl-run`` refuses it beside
            ``train.weight_decay=0``, where no tensor decays.
        progress: show a progress bar per epoch (drawn where stderr is a terminal or in a notebook, not into a
            log file: :mod:`petl.utils.progress`; ``petl-run`` logs a line per epoch either way).

    """

    epochs: int = option(PROTOCOL_EPOCHS, low=1)
    lr: float = option(1e-3, low=0, open_low=True)
    weight_decay: float = option(1e-4, low=0)
    warmup_frac: float = option(0.1, low=0, high=1)
    # torch takes 0 to 1; at 1 every target is the uniform distribution, whatever the label.
    label_smoothing: float = option(0.0, low=0, high=1, open_high=True)
    grad_clip: float = option(0.0, low=0)
    backbone_mode: str = option("auto", choices=BACKBONE_MODES)
    weight_decay_all: bool = False
    progress: bool = option(True, neutral=True)

    def __post_init__(self) -> None:
        # A node validates itself: every option's range and choices, read from its field (ValueError naming it).
        check_options(type(self), self, "train.")


def backbone_mode(model: nn.Module, settings: TrainSettings) -> str:
    """The mode, ``train`` or ``eval``, that ``settings.backbone_mode`` means for ``model``.

    ``auto`` reads the default of the method the model carries (found on any submodule, so a
    wrapped model works too); a model without a petl method trains whole, like plain fine-tuning.

    Raises:
        ConfigError: ``train`` or ``eval`` given for a backbone they cannot act on (:func:`check_backbone_mode`).

    """
    if settings.backbone_mode != "auto":
        check_backbone_mode(model, settings.backbone_mode)
        return settings.backbone_mode
    config = next((m.petl_config for m in model.modules() if getattr(m, "petl_config", None) is not None), None)
    return "train" if config is None else config.backbone_mode


def check_backbone_mode(
    model: nn.Module, mode: str, key: str = "TrainSettings.backbone_mode", remedy: str = "timm's drop_path_rate"
) -> None:
    """Refuse ``train`` or ``eval`` on a backbone holding no dropout, drop-path rate or BatchNorm.

    Train and eval mode differ only in those (a hybrid ViT's CNN stem may hold BatchNorms: in train mode they
    normalise by the batch's statistics), so without any the mode changes nothing.  The backbone's own modules
    count, not those a petl wrapper adds beside the layer it wraps (prompt and LoRA dropout run in train mode
    either way) nor the classifier head (Mlp-k's).  ``petl-run`` checks its config with this (``key``
    ``train.backbone_mode``) before it builds anything; :func:`backbone_mode` checks every model it trains.

    Args:
        model: the backbone, with or without a petl method applied.
        mode: ``auto``, ``train`` or ``eval`` (``auto`` always passes).
        key: the setting's name in the message.
        remedy: what gives the backbone a rate, said after "drop ``key``, or give".

    Raises:
        ConfigError: naming ``key`` and what to do.

    """
    from torch.nn.modules.batchnorm import _BatchNorm

    if mode == "auto":
        return
    added = {
        id(inner)
        for wrapper in model.modules()
        if isinstance(wrapper, PetlModule)
        for name, child in wrapper.named_children()
        if name != "base"
        for inner in child.modules()
    }
    # The classifier too: a method's head (Mlp-k's BatchNorm1d and dropout) is not the backbone's, and petl-run checks
    # the backbone before the method adds it (timm's own heads are a plain Linear).
    for module in model.modules():
        head = module.get_classifier() if callable(getattr(module, "get_classifier", None)) else None
        if isinstance(head, nn.Module):
            added |= {id(inner) for inner in head.modules()}
    own = [m for m in model.modules() if id(m) not in added]
    if not any(is_stochastic(m) or isinstance(m, _BatchNorm) for m in own):
        raise ConfigError(
            f"{key}={mode} cannot act: the backbone holds no dropout, drop-path rate or BatchNorm, so it runs alike "
            f"in train and eval mode; drop {key}, or give {remedy}"
        )


def is_stochastic(module: nn.Module) -> bool:
    """A dropout, drop-path or patch-dropout module with a non-zero rate."""
    from timm.layers import DropPath, PatchDropout

    if isinstance(module, nn.Dropout):
        return module.p > 0
    if isinstance(module, DropPath):
        return module.drop_prob > 0
    return isinstance(module, PatchDropout) and module.prob > 0


def set_train_mode(model: nn.Module, mode: str = "eval") -> None:
    """Put ``model`` in train mode for a training epoch, the frozen backbone as ``mode`` says.

    ``train``: every module, frozen or not, so the backbone's dropout and drop-path act.
    ``eval``: only what learns.  A module whose parameters all train (the head, unfrozen blocks,
    the whole model for full fine-tuning) goes to train mode with its children.  A petl wrapper
    trains its own modules (prompt dropout, LoRA dropout) but leaves its frozen ``base`` in eval mode.
    """
    if mode == "train":
        model.train()
        return
    model.eval()
    for module in model.modules():
        params = list(module.parameters())
        if params and all(p.requires_grad for p in params):
            module.train()
        elif isinstance(module, PetlModule):
            module.training = True
            for name, child in module.named_children():
                if name != "base":
                    child.train()


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer updates (only those that require grad)."""
    return [p for p in model.parameters() if p.requires_grad]


def no_weight_decay_names(model: nn.Module) -> set[str]:
    """Names of the parameters exempt from weight decay by default.

    Every 1-D tensor (biases, norm weights) as timm's ``param_groups_weight_decay`` does, plus
    what any submodule lists in its ``no_weight_decay()`` (timm's ViT: position embedding, class
    and register tokens; petl's prompt wrappers: their prompts), named from ``model``'s root.
    """
    names = {n for n, p in model.named_parameters() if p.ndim <= 1 or n.endswith(".bias")}
    for prefix, module in model.named_modules():
        listed = getattr(module, "no_weight_decay", None)
        if callable(listed):
            names |= {f"{prefix}.{n}" if prefix else n for n in listed()}
    return names


def param_groups(model: nn.Module, settings: TrainSettings) -> list[dict]:
    """The optimizer's parameter groups: decayed and (unless ``weight_decay_all``) exempt tensors."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    skip = set() if settings.weight_decay_all else no_weight_decay_names(model)
    groups = [
        {"params": [p for n, p in named if n not in skip], "weight_decay": settings.weight_decay},
        {"params": [p for n, p in named if n in skip], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


# The first step of a warm-up of w steps runs at 1/w of the lr (factor in build_optimizer): one of a single step runs
# at the full lr, as no warm-up would (it only holds the peak a step longer), so two are the least that warm up.
LEAST_WARMUP_STEPS = 2


def warmup_steps(warmup_frac: float, total: int) -> int:
    """The scheduler steps of linear warm-up: ``warmup_frac`` of ``total``, rounded down (0: no warm-up)."""
    return int(warmup_frac * total)


def refuse_idle_warmup(
    warmup_frac: float, epochs: int, steps_per_epoch: int, num_processes: int = 1, option: str = "train.warmup_frac="
) -> None:
    """Refuse a ``warmup_frac`` other than 0 that warms up fewer than :data:`LEAST_WARMUP_STEPS` scheduler steps.

    The rule of petl-run's ``train.warmup_frac`` and petl-pretrain's ``--warmup-frac`` (both schedules are
    :func:`build_optimizer`'s): 0.05 of a run of 10 steps warms up for none, as 0 would, and 0.5 of a run of 2 steps
    for one, at the full lr.  Each caller decides whether its default is checked.

    Args:
        warmup_frac: the fraction asked.
        epochs: the run's epochs.
        steps_per_epoch: optimizer steps per epoch of one process.
        num_processes: accelerate steps the scheduler once per process at each optimizer step.
        option: how the command names the option, up to its value (``train.warmup_frac=``, ``--warmup-frac ``).

    Raises:
        ConfigError: naming the option, the run's steps and the least fraction that warms up.

    """
    if warmup_frac == 0:
        return
    total = max(1, epochs * steps_per_epoch * num_processes)
    if warmup_steps(warmup_frac, total) >= LEAST_WARMUP_STEPS:
        return
    least = math.ceil(1000 * LEAST_WARMUP_STEPS / total) / 1000  # rounded up: two steps at least
    todo = f"{option}{least:g} or more, or 0" if least <= 1 else f"{option}0"
    raise ConfigError(
        f"{option}{warmup_frac:g} cannot act: the run takes {plural(total // num_processes, 'optimizer step')} "
        f"({plural(epochs, 'epoch')} of {steps_per_epoch}), and {warmup_frac:g} of them warms up for none (a "
        f"warm-up of one step runs that step at the full lr); give {todo}"
    )


def build_optimizer(
    model: nn.Module, settings: TrainSettings, steps_per_epoch: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters and a per-step cosine schedule with linear warm-up."""
    if not trainable_parameters(model):
        raise ValueError("the model has no trainable parameters")
    optimizer = torch.optim.AdamW(param_groups(model, settings), lr=settings.lr, weight_decay=settings.weight_decay)
    total = max(1, settings.epochs * steps_per_epoch)
    warmup = warmup_steps(settings.warmup_frac, total)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def fresh_accelerator(**kwargs: Any) -> Accelerator:
    """``Accelerator(**kwargs)``, whatever an earlier one in this process was made with.

    One process may run many trainings and pretrainings (notebooks, the benchmark harness, a test session):
    accelerate keeps its precision and accumulation settings in process-wide singletons that refuse to change once
    set (a GPU run's bf16, then a pretraining's ``mixed_precision='no'``), so each starts them afresh.  The
    distributed state (PartialState) is kept.
    """
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(**kwargs)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, accelerator: Accelerator) -> float:
    """Top-1 accuracy in percent over a loader (all processes gathered)."""
    model.eval()
    correct = total = 0
    for images, labels in loader:
        logits = model(images)
        pred, labels = accelerator.gather_for_metrics((logits.argmax(-1), labels))
        correct += int((pred == labels).sum())
        total += labels.numel()
    return 100.0 * correct / max(1, total)


def accumulation_weights(loader: DataLoader, grad_accum: int, num_processes: int = 1) -> list[float]:
    """The factor on each batch's mean loss that makes an accumulated step's gradient the mean over its images.

    accelerate divides every micro-batch's loss by ``grad_accum``: right for a step of ``grad_accum`` full batches,
    but an epoch's last step may hold fewer batches (the loader's length not a multiple of ``grad_accum``), or a
    shorter last batch, and would be scaled down.  Each batch is weighted by its images over its step's, times
    ``grad_accum``, so every step's gradient is what one batch of its images would give.  1.0 (the loss unchanged)
    for every batch of a full step and without accumulation; several processes' batches are all full (accelerate
    fills the last with images from the start), so there only the last step's count of batches matters.

    Args:
        loader: the training loader (prepared or not); one without a batch size or a length gets no weights.
        grad_accum: micro-batches per optimizer step.
        num_processes: processes training together.

    Returns:
        One weight per batch of ``loader`` on this process, in order; empty where they are all 1.

    """
    batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if grad_accum == 1 or not batch_size:
        return []
    try:
        batches, images = len(loader), len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:  # an iterable dataset: no lengths to weigh by
        return []
    sizes = [batch_size] * batches
    if batches and num_processes == 1:
        sizes[-1] = min(batch_size, images - (batches - 1) * batch_size)  # a full last batch under drop_last
    weights = []
    for first in range(0, batches, grad_accum):
        step = sizes[first : first + grad_accum]
        weights += [size * grad_accum / sum(step) for size in step]
    return weights


def train_one_epoch(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    accelerator: Accelerator,
    settings: TrainSettings,
    description: str = "train",
) -> dict[str, float]:
    """One pass over ``loader``; returns the lr of its last optimizer step, mean loss, train top-1 (%), images seen,
    the top-1 (%) of always guessing the epoch's most frequent label (``majority_top1``, the rate a model stuck on one
    class reaches: :mod:`petl.train.learning` tests train top-1 against it), the mean loss of always predicting the
    epoch's label shares (``prior_loss``, the loss a model that learned only them ends at:
    :func:`petl.train.learning.prior_loss`) and images/s.

    Raises:
        NonFiniteLossError: when the loss is NaN or infinite, or a step overflows float32 (the caller keeps its last
            checkpoint).

    """
    set_train_mode(model, backbone_mode(model, settings))
    loss_fn = nn.CrossEntropyLoss(label_smoothing=settings.label_smoothing)
    params = trainable_parameters(model)
    weights = accumulation_weights(loader, accelerator.gradient_accumulation_steps, accelerator.num_processes)
    loss_sum = correct = seen = 0.0
    # The epoch's labels, counted once it ends, on the CPU (no CUDA bincount kernel): a count per batch would copy
    # each batch's labels to the CPU, one more wait for the GPU every step.
    epoch_labels: list[torch.Tensor] = []
    lr = optimizer.param_groups[0]["lr"]
    start = time.perf_counter()
    bar = progress_bar(loader, desc=description, leave=False, show=settings.progress and accelerator.is_main_process)
    for index, (images, labels) in enumerate(bar):
        with accelerator.accumulate(model):
            logits = model(images)
            loss = loss_fn(logits, labels)
            if not torch.isfinite(loss):
                raise NonFiniteLossError(f"loss became {loss.item()} at {description}")
            weight = weights[index] if index < len(weights) else 1.0
            accelerator.backward(loss if weight == 1.0 else loss * weight)
            if settings.grad_clip > 0 and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(params, settings.grad_clip)
            if accelerator.sync_gradients:
                lr = optimizer.param_groups[0]["lr"]  # what this step runs at (the scheduler moves it on below)
            try:
                optimizer.step()
            except RuntimeError as error:
                # A step past float32's range (AdamW's first is 10 lr: an lr past 3.4e37): torch refuses to take it
                # rather than write inf, the non-finite weight the check after the epoch would find.
                if "without overflow" not in str(error):
                    raise
                raise NonFiniteLossError(f"the optimizer step overflowed float32 at {description} ({error})") from None
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        hits = (logits.argmax(-1) == labels).float()
        if accelerator.num_processes > 1:
            # Each process's sampler pads its last batch with repeated images so that every process steps
            # together; gather_for_metrics drops that padding, so each real image counts once (on every process).
            per_image = nn.functional.cross_entropy(
                logits.detach().float(), labels, reduction="none", label_smoothing=settings.label_smoothing
            )
            per_image, hits, labels = accelerator.gather_for_metrics((per_image, hits, labels))
            batch_loss = float(per_image.sum())
        else:
            batch_loss = loss.item() * labels.numel()
        n = hits.numel()
        epoch_labels.append(labels.detach().flatten())
        loss_sum += batch_loss
        correct += float(hits.sum())
        seen += n
        rate = seen / max(1e-9, time.perf_counter() - start)
        bar.set_postfix(loss=f"{loss_sum / seen:.3f}", acc=f"{100 * correct / seen:.1f}", img_s=f"{rate:.0f}")
    seconds = time.perf_counter() - start
    classes = int(logits.shape[-1]) if epoch_labels else 0
    label_counts = torch.bincount(torch.cat(epoch_labels).cpu()) if epoch_labels else torch.zeros(0, dtype=torch.long)
    if accelerator.num_processes > 1:
        # The counts above are already the whole epoch's (gathered per batch); the time is the slowest process's.
        seconds = float(accelerator.gather(torch.tensor([seconds], device=accelerator.device)).max())
    return {
        "lr": lr,
        "loss": loss_sum / max(1, seen),
        "train_top1": 100.0 * correct / max(1, seen),
        "images": seen,
        "majority_top1": 100.0 * int(label_counts.max()) / max(1, seen) if len(label_counts) else 0.0,
        "seconds": seconds,
        "images_per_second": seen / max(1e-9, seconds),
        # Over the head's classes: under label smoothing a class the epoch did not draw still takes its share.
        **({"prior_loss": prior_loss(label_counts.tolist(), classes, settings.label_smoothing)} if seen else {}),
    }


def fit(
    model: nn.Module,
    train_loader: DataLoader,
    eval_loaders: dict[str, DataLoader],
    settings: TrainSettings,
    accelerator: Accelerator,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    start_epoch: int = 0,
    on_epoch_end: Callable[[int, dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Train from ``start_epoch`` to ``settings.epochs``, evaluating on every loader after each epoch.

    Model, loaders, optimizer and scheduler must already be prepared by ``accelerator``.

    Args:
        model: the model; only parameters that require grad are in ``optimizer``.
        train_loader: the training loader.
        eval_loaders: loaders evaluated after each epoch, by name (e.g. ``{"val": ...}``).
        settings: optimisation settings.
        accelerator: the accelerate Accelerator owning devices and precision.
        optimizer: from :func:`build_optimizer` (prepared).
        scheduler: from :func:`build_optimizer` (prepared).
        start_epoch: the first epoch to run (a resumed run starts past its checkpoint).
        on_epoch_end: called with (epoch, metrics) after each epoch, e.g. to checkpoint.

    Returns:
        The per-epoch metrics.

    Raises:
        NonFiniteLossError: the loss, or after an epoch a trained weight, is NaN or infinite.

    """
    history = []
    epochs: Iterable[int] = range(start_epoch, settings.epochs)
    for epoch in epochs:
        if hasattr(train_loader, "set_epoch"):
            # Samplers that draw each epoch's order from (seed, epoch), like DistributedSampler, need
            # the epoch number; it is also what lets a resumed run see the same batches as an
            # uninterrupted one.  accelerate's prepared loaders pass it on to their sampler.
            train_loader.set_epoch(epoch)
        description = f"epoch {epoch + 1}/{settings.epochs}"
        metrics = train_one_epoch(model, train_loader, optimizer, scheduler, accelerator, settings, description)
        # A step with a finite loss may still write NaN or inf into the weights (an overflowing gradient): the next
        # loss says so, but after the last step of a run none comes, and its result and checkpoint would hold them.
        params = trainable_parameters(model)
        if params and not bool(torch.stack([p.detach().isfinite().all() for p in params]).all()):
            raise NonFiniteLossError(f"the trained weights became non-finite (NaN or inf) at {description}")
        for name, loader in eval_loaders.items():
            metrics[f"{name}_top1"] = evaluate(model, loader, accelerator)
        # "lr" is the epoch's last step's (read after the schedule has moved on, the last epoch's would be 0).
        metrics = {"epoch": epoch + 1, **metrics}
        history.append(metrics)
        if on_epoch_end is not None:
            on_epoch_end(epoch, metrics)
    return history


def enable_grad_checkpointing(model: nn.Module) -> None:
    """Turn on timm's gradient checkpointing: blocks run through ``checkpoint_seq``, which keeps only each
    block's input and recomputes the rest in the backward.

    timm checkpoints without re-entrancy by default, so parameters inside a block get their gradient
    even when the block's input does not require grad (frozen stem, LoRA in the first block).  Petl
    wrappers sit inside blocks or replace single blocks, so every method runs through it.

    Raises:
        ConfigError: the model has no ``set_grad_checkpointing``, or refuses it (a side-network method:
            :func:`petl.model.timm_api.set_grad_checkpointing`); the message names ``train.grad_checkpointing``.

    """
    if not hasattr(model, "set_grad_checkpointing"):
        raise ConfigError(f"train.grad_checkpointing: {type(model).__name__} has no set_grad_checkpointing")
    try:
        model.set_grad_checkpointing(True)
    except ValueError as error:
        reason = str(error).removeprefix("gradient checkpointing: ")
        raise ConfigError(f"train.grad_checkpointing=true: {reason} (train.grad_checkpointing=false)") from None


def compiler_missing(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot run on ``device_type``, or None when it can.

    On CPU, inductor generates C++ and needs a compiler (``$CXX``, g++, clang++ or c++) on the PATH.
    """
    if device_type != "cpu":
        return None
    names = [os.environ.get("CXX", ""), "g++", "clang++", "c++"]
    if any(name and shutil.which(name) for name in names):
        return None
    return "torch.compile on CPU needs a C++ compiler (g++ or clang++) and none is on the PATH"
