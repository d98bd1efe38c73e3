"""One run, end to end: build, (resume,) train, evaluate, record.  Shared by petl-run and Python.

Protocol (VTAB-1k): decisions are made on val only; the test split is evaluated once, after the
final epoch, so no choice can ever be made on test accuracy.  ``data.split=train800val200`` trains
on all 1,000 examples and has no val split.

Files in ``output_dir``: ``config.yaml`` (resolved, at start), ``metrics.jsonl`` (one line per
epoch), ``checkpoint.pt`` (each epoch, removed at the end unless ``train.keep_checkpoint``),
``trainable.safetensors`` and finally ``result.json``, whose presence marks a finished run.  While a
run goes on, ``.petl.lock`` (:mod:`petl.store.lock`) keeps a second run out of the folder.

:func:`run` claims the folder and checks what an earlier run left there (:mod:`petl.train.output_dir`);
:func:`_train_and_record` reads top-down: build the model and the data (:mod:`petl.train.build`),
check a resume against the data and weights files, set up the loaders (over cached features where
the method allows) and optimizer, restore the checkpoint, fit the epochs, evaluate test once, record.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn
from torch.utils.data import DataLoader, Dataset

import petl.methods  # noqa: F401  (importing the methods registers them)
from petl import data as petl_data
from petl.data.images import decode_progress
from petl.model.io import save_trainable
from petl.model.params import count_params, trainable_state, trained_by_an_earlier_method
from petl.model.registry import get_method
from petl.store import files, run_card
from petl.store.result import RunResult, write_result
from petl.train import build, cache, config, engine, learning
from petl.train import output_dir as folder
from petl.train.config import ConfigError
from petl.train.engine import NonFiniteLossError, TrainSettings, backbone_mode, build_optimizer, evaluate, fit
from petl.train.output_dir import check_finished
from petl.utils.distributed import is_main_process
from petl.utils.errors import DivergedError, RunError
from petl.utils.memory import peak_memory, reset_peak_rss
from petl.utils.once import warn_once
from petl.utils.provenance import git_commit, versions
from petl.utils.random import rng_state, set_rng_state
from petl.utils.text import first_line, plural

log = logging.getLogger(__name__)

__all__ = ["ConfigError", "DivergedError", "RunError", "check_finished", "run", "summary_line", "train"]


def train(cfg: DictConfig | dict[str, Any]) -> dict[str, Any]:
    """Run the training engine from Python: the same run ``petl-run`` does, without a subprocess.

    Args:
        cfg: a config from :func:`petl.run.default_config` or a nested dict; a dict may be partial
            (``{"method": {"name": "lora", "rank": 4}, "train": {"epochs": 5}}``): what it leaves
            out takes the defaults, and everything is type- and range-checked.

    Returns:
        The ``result.json`` record (accuracies in percent).

    Raises:
        ConfigError: bad input (unknown choice or key, value of the wrong type or out of range).
        RunError: the run could not complete; checkpoints of finished epochs are kept.

    """
    return run(config.to_config(cfg))


def _weights_sha256(cfg: DictConfig, model: nn.Module) -> str | None:
    """SHA-256 of the local file the pretrained weights came from (``None``: no weights, or a hub download).

    Rows of a leaderboard that ran on several machines show by it that they used the same weights.
    """
    file = getattr(model, "pretrained_cfg", {}).get("file") if cfg.model.pretrained else None
    return files.file_sha256(Path(file)) if file and Path(file).is_file() else None


def summary_line(result: dict[str, Any]) -> str:
    """One line for the console: method, task, accuracies, trainable parameters, time ("-" where unknown), and why
    the run did not learn where it did not (:mod:`petl.train.learning`): its scores are then a guess's.

    ``result`` is a record as written or as read (:func:`petl.store.result.read_result` has checked its types).
    """

    def shown(key: str, spec: str) -> str:
        return "-" if result.get(key) is None else format(result[key], spec)

    stuck = f" | did not learn: {result['not_learned']}" if result.get("not_learned") else ""
    return (
        f"{result['method']} on {result['dataset']} ({result.get('model')}, seed {result['seed']}): "
        f"val {shown('val_top1', '.2f')}  test {shown('test_top1', '.2f')}  | "
        f"{shown('trainable_params', ',')} trainable params | {shown('train_seconds', '.0f')} s{stuck}"
    )


def run(cfg: DictConfig, *, checked: bool = False) -> dict[str, Any]:
    """Run a composed config (:func:`train` completes and checks one first).

    Args:
        cfg: a composed run config.
        checked: ``cfg`` comes from :func:`petl.train.config.default_config` unchanged (petl-run's
            own path), so its values are not checked a second time.

    """
    if not checked:
        config.check_values(cfg)
    build.resolve_precision(cfg)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as error:
        raise ConfigError(config.explain(error)) from None
    assert isinstance(resolved, dict)
    out = Path(cfg.output_dir)
    # Decoding a folder of photos (before the first epoch, or to check a finished run's data) says how far it is.
    decoding = decode_progress(log.info if cfg.train.progress and is_main_process() else None)
    with folder.claim(out), decoding:
        finished = folder.check_output_dir(out, cfg, resolved, is_main=is_main_process())
        if finished is not None:
            if is_main_process():
                log.info("already finished: %s", summary_line(finished.to_json()))
            return finished.to_json()

        accelerator = build.make_accelerator(cfg, out)
        deterministic_before = torch.are_deterministic_algorithms_enabled()
        # warn_only: an op without a deterministic kernel warns instead of stopping the run.
        torch.use_deterministic_algorithms(cfg.train.deterministic, warn_only=True)
        # Process-wide switches, put back after the run (one process may run many: notebooks, petl-bench).
        switches = build.cuda_switches(cfg.train.precision, cfg.train.deterministic, accelerator.device.type)
        try:
            with switches:
                return _train_and_record(cfg, resolved, out, accelerator)
        finally:
            torch.use_deterministic_algorithms(deterministic_before)
            if cfg.train.trackers:
                accelerator.end_training()


def split_meaning(info: petl_data.DatasetInfo, split: str, images: int) -> str | None:
    """What a split of the user's own data holds (``None`` for a benchmark's, whose name says it).

    The protocol's split names come from VTAB-1k (800 training and 200 validation images); on a folder or a saved
    dataset ``train800`` is the training images less the held-out val200, whatever their number.
    """
    if info.root != "required":
        return None
    if split == petl_data.TRAIN_VAL:
        return f"{split}: every training image (val200 included): {images} images"
    held = info.val_from_train or "the data's own validation split"
    return f"{split}: the training images less val200 ({held}): {images} images"


def method_label(cfg: DictConfig) -> str:
    """The method as configured: its name and the options that differ from its defaults (``adapter (style=parallel,
    dim=8)``), so that two experiments of one method read apart in a sweep's log.
    """
    name = cfg.method.name
    defaults = {}
    for f in dataclasses.fields(get_method(name).config_cls):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    changed = {k: v for k, v in config.method_options(cfg).items() if k in defaults and v != defaults[k]}
    if not changed:
        return name
    shown = (f"{k}={','.join(map(str, v)) if isinstance(v, tuple | list) else v}" for k, v in changed.items())
    return f"{name} ({', '.join(shown)})"


def batch_words(batch_size: int, train_size: int) -> str:
    """The training batch for the console: ``batch 64``, or the whole split where ``train.batch_size`` is above it.

    Not refused: the default 64 is above a small folder of own images, whose run then takes all of them a step.
    """
    if batch_size <= train_size:
        return f"batch {batch_size}"
    return f"batch {train_size} (all the training images: train.batch_size={batch_size} is more)"


def effective_batch_size(cfg: DictConfig, train_size: int, num_processes: int) -> int:
    """Images per full optimizer step: ``train.batch_size`` x processes x ``train.grad_accum``, at most the split.

    A batch size above the training split takes the whole split a step (``train.grad_accum`` above the batches an
    epoch holds is refused, so it never multiplies a split of one batch).
    """
    return min(cfg.train.batch_size * num_processes * cfg.train.grad_accum, train_size)


def device_label(accelerator: Accelerator) -> str:
    """Where and in what precision a run trains, in words: ``on cpu in fp32``, ``on cuda in bf16 autocast, TF32``.

    Several processes are counted (``on 4 processes of cuda in ...``); the precision is accelerate's autocast and
    whether the fp32 matmuls run in TF32, as ``result.json`` records them (``precision``, ``tf32``).
    """
    device = accelerator.device.type
    where = f"{accelerator.num_processes} processes of {device}" if accelerator.num_processes > 1 else device
    return f"on {where} in {precision_label(accelerator)}"


def precision_label(accelerator: Accelerator) -> str:
    """The precision a run trains in, in words: ``fp32``, ``bf16 autocast``, ``bf16 autocast, TF32``."""
    words = [f"{accelerator.mixed_precision} autocast" if accelerator.mixed_precision != "no" else "fp32"]
    if accelerator.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        words.append("TF32")
    return ", ".join(words)


def _train_and_record(cfg: DictConfig, resolved: dict[str, Any], out: Path, accelerator: Accelerator) -> dict[str, Any]:
    """The protocol: build, check the resume, train, evaluate test once, record."""
    started = time.perf_counter()
    set_seed(cfg.seed)
    info = config.data_info(cfg)
    if cfg.train.eval_test and petl_data.TEST not in info.splits:
        build.say(accelerator, "%s has no test split: this run reports no test accuracy", cfg.data.root)
    model = build.create_backbone(cfg)
    datasets = build.datasets(cfg, model)
    if len(datasets["train"]) < 2:
        # A lone image is a last batch of one, which the training loader leaves out (see _set_up_training): the run
        # would take no step and record a loss of 0.
        raise ConfigError(
            f"data {cfg.data.name}: the {cfg.data.split} split holds {plural(len(datasets['train']), 'image')}, too "
            "few to train on: give 2 or more (data.subset)"
        )
    # The schedule and resolution said up front (a folder run's 100 epochs or the default 32 px are not obvious),
    # and where it trains (a GPU torch cannot see trains nothing there, without an error), on stdout beside the
    # closing summary line: stderr stays for warnings and the one-line errors.
    if accelerator.is_main_process:
        size = build.eval_spec(cfg, model, info).image_size
        print(
            f"training {method_label(cfg)} on {cfg.data.name} ({len(datasets['train'])} images) at {size} px: "
            f"{plural(cfg.train.epochs, 'epoch')}, {batch_words(cfg.train.batch_size, len(datasets['train']))}, "
            f"lr {cfg.train.lr:g}, "
            f"{device_label(accelerator)}",
            flush=True,
        )
    inputs = folder.run_inputs(cfg, datasets["train"], datasets)
    checkpoint = folder.resume_checkpoint(out, cfg, inputs, accelerator.num_processes)
    method_cfg = build.method_config(cfg, model, info.num_classes, checkpoint, accelerator)
    build.apply_method(cfg, model, method_cfg)
    _check_batch_statistics(cfg, model)
    _check_grad_accum(cfg, len(datasets["train"]), accelerator.num_processes)
    _check_warmup(cfg, len(datasets["train"]), accelerator.num_processes)
    if cfg.train.grad_checkpointing:
        config.check_grad_checkpointing_acts(cfg, model)  # composing checked it on the meta model, where it could
        engine.enable_grad_checkpointing(model)
    model.to(accelerator.device)
    _check_cache_option(cfg, model, datasets, accelerator)  # on the device: its autocast sets the cache's dtype
    # Every run's peak is its own, also when runs share a process (Hydra's in-process --multirun, a notebook).
    reset_peak_rss()
    if accelerator.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    progress = _Progress.start(checkpoint, started)
    if not cfg.resume and accelerator.is_main_process:
        folder.set_aside(out)  # model, data and method are built: the replacement can start
    with folder.disk_errors(out, lambda: progress.saved_epoch, cfg.resume):
        if accelerator.is_main_process:
            files.write_config(out, resolved)
    training = _set_up_training(cfg, model, datasets, accelerator)
    if checkpoint is not None:
        training.restore(checkpoint, out)
        build.say(accelerator, "resuming %s from epoch %d/%d", out, progress.start_epoch, cfg.train.epochs)
    with folder.disk_errors(out, lambda: progress.saved_epoch, cfg.resume):
        if accelerator.is_main_process:
            files.write_metrics(out / files.METRICS_FILE, progress.history)
    if cfg.train.trackers:
        accelerator.init_trackers("petl", config=_scalars(folder.flatten(resolved)))
    # Training time counts the cache once: a resumed session's caching was paid by the first session.
    progress.session_start = time.perf_counter() if checkpoint is not None else training.tick
    _fit_epochs(cfg, out, training, progress, inputs)
    # Read before the test pass: train_seconds is what training cost (a trial, which never tests, and a final run
    # then count alike); the test pass is recorded on its own.
    train_seconds = progress.seconds()
    tested = time.perf_counter()
    test_top1 = _evaluate_test_once(training)
    test_seconds = round(time.perf_counter() - tested, 2) if test_top1 is not None else None
    result = _result(
        cfg, model, info, len(datasets["train"]), progress, training, resolved, inputs,
        train_seconds=train_seconds, test_top1=test_top1, test_seconds=test_seconds,
    )  # fmt: skip
    card = run_card.model_card(
        model_cfg=resolved["model"], seed=cfg.seed, model=model, spec=build.eval_spec(cfg, model, info),
        class_names=result.class_names, dataset=cfg.data.name, checkpoint_sha256=result.checkpoint_sha256,
    )  # fmt: skip
    with folder.disk_errors(out, lambda: progress.saved_epoch, cfg.resume):
        _record(cfg, out, model, result, accelerator, card)
    build.say(accelerator, "wrote %s", out / files.RESULT_FILE)
    return result.to_json()


def _check_batch_statistics(cfg: DictConfig, model: nn.Module) -> None:
    """Refuse ``train.batch_size=1`` where a BatchNorm1d trains (Mlp-k's head, HST's): one image has no statistics.

    torch refuses such a batch at the first step ("Expected more than 1 value per channel"), after the build, as a
    run error (exit 1); it is bad input.

    Raises:
        ConfigError: naming the option, the module and what to give instead.

    """
    if cfg.train.batch_size != 1:
        return
    modes = [(module, module.training) for module in model.modules()]
    engine.set_train_mode(model, backbone_mode(model, cfg.train))  # the modes its training runs in
    trained = [name for name, m in model.named_modules() if isinstance(m, nn.BatchNorm1d) and m.training]
    for module, mode in modes:
        module.training = mode
    if trained:
        raise ConfigError(
            f"train.batch_size=1: method {cfg.method.name}'s {trained[0]} is a BatchNorm, which trains on the "
            "statistics of a batch and one image has none; give train.batch_size=2 or more"
        )


def _batches_per_process(cfg: DictConfig, train_size: int, num_processes: int) -> int:
    """The training batches of an epoch on each process, as the prepared training loader holds them."""
    batch = cfg.train.batch_size
    # The training loader leaves a lone last image out on one process (_set_up_training).
    batches = math.ceil(train_size / batch) - (num_processes == 1 and train_size % batch == 1)
    return math.ceil(batches / num_processes)


def _check_grad_accum(cfg: DictConfig, train_size: int, num_processes: int) -> None:
    """Refuse a ``train.grad_accum`` above the batches an epoch holds per process: a step never accumulates more.

    Raises:
        ConfigError: naming the option and the most that can act.

    """
    batch = cfg.train.batch_size
    most = _batches_per_process(cfg, train_size, num_processes)
    if cfg.train.grad_accum > most:
        per = f" per process ({num_processes})" if num_processes > 1 else ""
        raise ConfigError(
            f"train.grad_accum={cfg.train.grad_accum} cannot act: an epoch holds {plural(most, 'batch', 'batches')} "
            f"of train.batch_size={batch}{per}, and a step accumulates no more than those; give "
            f"train.grad_accum={most}{' or less' if most > 1 else ''}"
        )


def _check_warmup(cfg: DictConfig, train_size: int, num_processes: int) -> None:
    """Refuse a ``train.warmup_frac`` other than 0 and its default that warms up no step of this run's schedule.

    The rule is :func:`engine.refuse_idle_warmup`'s, shared with petl-pretrain's ``--warmup-frac``: the schedule
    warms up for ``warmup_frac`` of its steps rounded down, its first step at 1/steps of the lr, so 0.05 of a run of
    10 steps warmed up for none, as 0 would, and 0.5 of a run of 2 steps for one, at the full lr.  The default stays
    (a small folder's run is not refused for it).

    Raises:
        ConfigError: naming the option, the run's steps and the least fraction that warms up.

    """
    frac = cfg.train.warmup_frac
    if frac == config.option_default("train.warmup_frac"):
        return
    # As _set_up_training builds it: accelerate steps the scheduler once per process at each optimizer step.
    optimizer_steps = math.ceil(_batches_per_process(cfg, train_size, num_processes) / cfg.train.grad_accum)
    engine.refuse_idle_warmup(frac, cfg.train.epochs, optimizer_steps, num_processes)


def _cache_plan(
    model: nn.Module, settings: TrainSettings | DictConfig, datasets: dict[str, Dataset], accelerator: Accelerator
) -> tuple[cache.CachePlan | None, str | None]:
    """The features this run caches (``train.cache_features``), or ``None`` and why none (:func:`cache.decide`).

    ``model`` is on ``accelerator``'s device: the cache's size is the dtype its autocast leaves the front's output in.
    """
    return cache.decide(
        model,
        backbone_trains=backbone_mode(model, settings) == "train",
        augmented=build.is_augmented(datasets["train"]),
        sizes=[len(datasets[split]) for split in ("train", "val") if datasets.get(split)],
        autocast=accelerator.autocast,
    )


def _check_cache_option(
    cfg: DictConfig, model: nn.Module, datasets: dict[str, Dataset], accelerator: Accelerator
) -> None:
    """Refuse ``train.cache_features=false`` where this run would cache nothing anyway (LoRA: its first block trains).

    Raises:
        CacheOptionError: naming the option and why nothing is cached, before the run writes anything.

    """
    if cfg.train.cache_features:
        return
    config.check_cache_option_acts(cfg, model)  # composing checked it on the meta model, where it could
    _, uncached = _cache_plan(model, cfg.train, datasets, accelerator)  # the real data's size against its limit
    if uncached is not None:
        raise cache.CacheOptionError(uncached)


@dataclass
class _Progress:
    """Where training stands: epochs done, their metrics, time spent, the last epoch saved to disk."""

    start_epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds_before: float = 0.0
    saved_epoch: int = 0
    session_start: float = 0.0
    # Wall time, everything included (building, calibrating, testing), of the sessions before and of this one.
    wall_before: float = 0.0
    process_start: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(cls, checkpoint: dict[str, Any] | None, process_start: float) -> _Progress:
        if checkpoint is None:
            return cls(process_start=process_start)
        epoch, wall_before = checkpoint["epoch"], checkpoint.get("wall_seconds", 0.0)  # older checkpoints: none
        return cls(
            epoch,
            checkpoint["history"],
            checkpoint["seconds"],
            saved_epoch=epoch,
            wall_before=wall_before,
            process_start=process_start,
        )

    def seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.session_start

    def wall_seconds(self) -> float:
        return self.wall_before + time.perf_counter() - self.process_start


@dataclass
class _Setup:
    """The model as trained (maybe behind a feature cache), its loaders, optimizer and schedule."""

    model: nn.Module
    trainee: nn.Module
    train_loader: DataLoader
    eval_loaders: dict[str, DataLoader]
    test_loader: DataLoader | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    settings: TrainSettings
    accelerator: Accelerator
    cache_plan: cache.CachePlan | None
    tick: float
    steps_per_epoch: int  # optimizer steps (per process)

    def restore(self, checkpoint: dict[str, Any], out: Path) -> None:
        """Continue from ``out``'s checkpoint: weights, optimizer, schedule and every random generator.

        Raises:
            ConfigError: a tensor or state in it does not fit this run's model (a hand-edited or foreign file), or
                it lacks tensors the method trains (a run an earlier petl began, whose method trained fewer).

        """
        # trainable_state also holds buffers of trained modules (BatchNorm statistics in Mlp-k's head).
        params = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        expected, trained = trainable_state(self.model), checkpoint["trainable"]
        # Every trained tensor, each of its shape: one left out would resume at its initial value, unsaid.
        missing, unexpected = sorted(set(expected) - set(trained)), sorted(set(trained) - set(expected))
        unfit = [*missing, *unexpected]
        unfit += [n for n in expected if n in trained and expected[n].shape != trained[n].shape]
        earlier = trained_by_an_earlier_method(self.model, missing, unexpected)
        if earlier is not None and len(unfit) == len(missing):
            # Not damaged: a run an earlier petl began, when its method trained fewer tensors (an old Partial-k Swin).
            raise folder.older_checkpoint(out, earlier)
        if unfit:
            raise folder.damaged_checkpoint(out, f"trainable tensor {unfit[0]} does not fit the model")
        with torch.no_grad():
            for name, tensor in trained.items():
                params[name].copy_(tensor)
        try:
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.scheduler.load_state_dict(checkpoint["scheduler"])
            if checkpoint.get("scaler") is not None and self.accelerator.scaler is not None:
                self.accelerator.scaler.load_state_dict(checkpoint["scaler"])
            set_rng_state(checkpoint["rng"])
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as error:
            raise folder.damaged_checkpoint(out, first_line(error, type(error).__name__)[:200]) from None
        # load_state_dict takes moments of any shape; the first step would fail on them, after the resume began.
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                moments = self.optimizer.state.get(param, {}).values()
                if any(isinstance(t, torch.Tensor) and t.dim() and t.shape != param.shape for t in moments):
                    raise folder.damaged_checkpoint(out, "its optimizer state does not fit the trained tensors")


def _set_up_training(
    cfg: DictConfig, model: nn.Module, datasets: dict[str, Dataset], accelerator: Accelerator
) -> _Setup:
    """Loaders (over cached features where the method allows), optimizer and schedule, prepared."""
    # The train node is a TrainSettings (TrainConfig subclasses it): the engine reads it as it is.
    settings: TrainSettings = OmegaConf.to_object(cfg.train)
    settings = dataclasses.replace(settings, progress=settings.progress and accelerator.is_main_process)
    num_workers = cfg.data.num_workers
    train_set, val_set = datasets["train"], datasets.get("val")
    cache_plan, uncached = (
        _cache_plan(model, settings, datasets, accelerator) if cfg.train.cache_features else (None, None)
    )
    if uncached is not None and uncached != cache.NOTHING_FROZEN:
        build.say(accelerator, "not caching features: %s", uncached)
    trainee: nn.Module = model
    tick = time.perf_counter()
    if cache_plan is not None:
        trainee = cache.CachedTail(model, cache_plan)
        batch = cfg.train.eval_batch_size
        # A bar per split where the epochs have one (settings.progress: the main process's alone).
        train_bar, val_bar = ("train", "val") if settings.progress else (None, None)
        train_set = cache.cache_split(trainee, train_set, accelerator, batch, num_workers, train_bar)
        val_set = cache.cache_split(trainee, val_set, accelerator, batch, num_workers, val_bar) if val_set else None
        seconds = time.perf_counter() - tick
        build.say(accelerator, "cached %s of %d train images in %.1f s", cache_plan.describe(), len(train_set), seconds)

    if build.is_augmented(train_set):
        # Crops and flips from (seed, epoch, index): the same for any data.num_workers (a neutral key).
        train_set = build.SeededAugmentation(train_set, cfg.seed)
    sampler = build.EpochSampler(len(train_set), cfg.seed, train_set)
    # A last training batch of one image cannot be trained in batch statistics (Mlp-k's BatchNorm1d raises on
    # it; KMnP/vpt src/data/loader.py:L53-65 keeps it on one GPU and would fail the same way): that one image
    # is left out of the epoch, a different one each epoch since the order is reshuffled.  No other size drops.
    # Under several processes accelerate fills every process's last batch from the start, so none holds one image;
    # drop_last there would drop the last round of batches, not one image (17 of 49 in 16s on two processes).
    lone_last = accelerator.num_processes == 1 and len(train_set) % cfg.train.batch_size == 1
    train_loader = build.loader(train_set, cfg.train.batch_size, num_workers, cfg.seed, sampler, drop_last=lone_last)
    eval_loaders = {"val": build.loader(val_set, cfg.train.eval_batch_size, num_workers, cfg.seed)} if val_set else {}
    # A selection trial (train.eval_test=false) never builds the test split, let alone scores it.
    test_set = datasets.get("test")
    test_loader = None if test_set is None else build.loader(test_set, cfg.train.eval_batch_size, num_workers, cfg.seed)
    # Prepared first: under DDP each process gets its shard of the batches, evened out (ceil(batches / processes)).
    train_loader = accelerator.prepare(train_loader)
    # Each process takes an optimizer step per grad_accum of its own batches (and one after its last), and accelerate
    # steps the scheduler once per process at each: the schedule counts that many.  From the unsharded loader it
    # fell short wherever the batches do not divide among the processes, and the last steps ran at lr 0.
    optimizer_steps = math.ceil(len(train_loader) / cfg.train.grad_accum)
    optimizer, scheduler = build_optimizer(trainee, settings, optimizer_steps * accelerator.num_processes)
    batch = min(cfg.train.batch_size, len(train_set))  # a batch_size above the split takes the split
    few = learning.few_steps(optimizer_steps * cfg.train.epochs, len(train_set), batch, cfg.train.epochs)
    if few is not None and accelerator.is_main_process:
        warn_once(log, few)  # once per process: a sweep of such runs says it once, not once a run
    trainee, optimizer, scheduler = accelerator.prepare(trainee, optimizer, scheduler)
    test_loader = accelerator.prepare(test_loader) if test_loader is not None else None
    eval_loaders = {name: accelerator.prepare(loader) for name, loader in eval_loaders.items()}
    return _Setup(
        model, trainee, train_loader, eval_loaders, test_loader, optimizer, scheduler, settings, accelerator,
        cache_plan, tick, optimizer_steps,
    )  # fmt: skip


def _fit_epochs(cfg: DictConfig, out: Path, training: _Setup, progress: _Progress, inputs: dict[str, Any]) -> None:
    """Train the remaining epochs, checkpointing each one (val is evaluated per epoch, test never)."""
    accelerator, model, optimizer, scheduler = (
        training.accelerator,
        training.model,
        training.optimizer,
        training.scheduler,
    )

    def on_epoch_end(epoch: int, metrics: dict[str, float]) -> None:
        progress.history.append(metrics)
        if accelerator.is_main_process:
            state = {
                "epoch": epoch + 1,
                "trainable": {k: v.cpu() for k, v in trainable_state(model).items()},
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": rng_state(),
                # fp16's loss scale: restarted at its initial value, a resumed run would skip other steps.
                "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
                "history": progress.history,
                "seconds": progress.seconds(),
                "wall_seconds": progress.wall_seconds(),
                "inputs": inputs,
                # The effective batch counts the processes: a resume under another count would mix two runs.
                "num_processes": accelerator.num_processes,
                # What the method's calibrate hook chose: a resume must rebuild the same modules.
                "method_config": dataclasses.asdict(model.petl_config),
            }
            # Checkpoint first, then the metrics line: a crash in between leaves a line too few,
            # and a resume rewrites metrics.jsonl from the checkpoint's history anyway.
            with folder.disk_errors(out, lambda: progress.saved_epoch, cfg.resume):
                files.save_checkpoint(out / files.CHECKPOINT_FILE, state)
                progress.saved_epoch = epoch + 1
                files.append_metrics(out / files.METRICS_FILE, metrics)
        accelerator.wait_for_everyone()
        val = f"  val {metrics['val_top1']:.2f}" if "val_top1" in metrics else ""
        build.say(
            accelerator,
            "epoch %d/%d  loss %.4f  train %.2f%s  %.0f img/s",
            epoch + 1,
            training.settings.epochs,
            metrics["loss"],
            metrics["train_top1"],
            val,
            metrics["images_per_second"],
        )
        if cfg.train.trackers:
            accelerator.log(metrics, step=epoch + 1)

    try:
        fit(
            training.trainee, training.train_loader, training.eval_loaders, training.settings, accelerator,
            optimizer, scheduler, progress.start_epoch, on_epoch_end,
        )  # fmt: skip
    except NonFiniteLossError as error:
        done = len(progress.history)
        kept = f"the checkpoint of epoch {done} is kept" if done else "no epoch had finished"
        raise DivergedError(
            f"{error}: training stopped ({kept}); lower train.lr (with resume=false) or check the data"
        ) from None


def _evaluate_test_once(training: _Setup) -> float | None:
    """Test accuracy of the final model: the only time the test split is looked at (None for a trial)."""
    if training.test_loader is None:
        return None
    # Without the compile wrapper: a CachedTail is swapped for the whole model to test on images.
    full_model = training.accelerator.unwrap_model(training.trainee, keep_torch_compile=False)
    full_model = full_model.model if isinstance(full_model, cache.CachedTail) else full_model
    # The unwrapped model is outside the autocast accelerate put around the prepared one: test under the
    # same precision as training and val did (a no-op in fp32).
    with training.accelerator.autocast():
        return evaluate(full_model, training.test_loader, training.accelerator)


def _record(
    cfg: DictConfig, out: Path, model: nn.Module, result: RunResult, accelerator: Accelerator, card: dict[str, Any]
) -> None:
    """Weights and model.json, then ``result.json`` (its presence marks the run finished), then drop the checkpoint."""
    if accelerator.is_main_process:
        save_trainable(model, out / files.WEIGHTS_FILE)  # atomically
        run_card.write_card(out, card)
        write_result(out / files.RESULT_FILE, result)
        if not cfg.train.keep_checkpoint:
            (out / files.CHECKPOINT_FILE).unlink(missing_ok=True)
    accelerator.wait_for_everyone()


def _scalars(flat: dict[str, Any]) -> dict[str, Any]:
    # Trackers (TensorBoard hparams) accept scalars and strings only.
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()}


def _result(
    cfg: DictConfig,
    model: nn.Module,
    info: petl_data.DatasetInfo,
    train_size: int,
    progress: _Progress,
    training: _Setup,
    resolved: dict[str, Any],
    inputs: dict[str, Any],
    *,
    train_seconds: float,
    test_top1: float | None,
    test_seconds: float | None,
) -> RunResult:
    """The run's record, built once from everything it says (``train_seconds`` read before the test pass)."""
    accelerator, cache_plan = training.accelerator, training.cache_plan
    num_classes, history = info.num_classes, progress.history
    counts = count_params(model)
    peak_mb, peak_kind = peak_memory(accelerator.device.type)
    images = sum(h["images"] for h in history)
    seconds = sum(h["seconds"] for h in history)
    last = history[-1] if history else {}
    val_history = [h["val_top1"] for h in history if "val_top1" in h]
    return RunResult(
        method=cfg.method.name,
        method_config=dataclasses.asdict(model.petl_config),
        dataset=cfg.data.name,
        split=cfg.data.split,
        model=cfg.model.name,
        # false also where the weights came from a local file (model.checkpoint): not the tag's published ones.
        pretrained=bool(cfg.model.pretrained and not cfg.model.checkpoint),
        checkpoint=cfg.model.checkpoint if cfg.model.pretrained else None,
        seed=cfg.seed,
        num_classes=num_classes,
        trainable_params=counts.trainable,
        trainable_params_no_head=counts.trainable_no_head,
        total_params=counts.total,
        val_top1=last.get("val_top1"),
        best_val_top1=max(val_history) if val_history else None,
        test_top1=test_top1,
        final_train_loss=last.get("loss"),
        final_train_top1=last.get("train_top1"),
        not_learned=learning.not_learned(
            [h.get("loss") for h in history],
            num_classes,
            last.get("train_top1"),
            last.get("images"),
            last.get("majority_top1"),
            last.get("prior_loss"),
        ),
        epochs=cfg.train.epochs,
        train_seconds=round(train_seconds, 2),
        images_per_second=round(images / seconds, 1) if seconds else None,
        feature_cache=cache_plan.describe() if cache_plan else None,
        device=str(accelerator.device),
        num_processes=accelerator.num_processes,
        precision=accelerator.mixed_precision,
        # Read off torch's switch as the run left it (the runner sets it on CUDA): fp32 matmuls ran in TF32.
        tf32=accelerator.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32,
        # What really ran: train.compile falls back to eager (with a warning) where no compiler is found.
        compiled=accelerator.state.dynamo_plugin.backend.value != "NO",
        effective_batch_size=effective_batch_size(cfg, train_size, accelerator.num_processes),
        optimizer_steps=training.steps_per_epoch * cfg.train.epochs,
        versions=versions(),
        **git_commit(),
        output_dir=str(cfg.output_dir),
        finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        test_seconds=test_seconds,
        peak_memory_mb=round(peak_mb, 1),
        peak_memory_kind=peak_kind,
        config=resolved,
        inputs=inputs,
        weights_sha256=_weights_sha256(cfg, model),
        checkpoint_sha256=inputs["model.checkpoint_sha256"],
        class_names=list(info.class_names or (str(i) for i in range(num_classes))),
        val_from_train=info.val_from_train,
        split_meaning=split_meaning(info, cfg.data.split, train_size),
        has_test_split=petl_data.TEST in info.splits,
        wall_seconds=round(progress.wall_seconds(), 2),
    )
