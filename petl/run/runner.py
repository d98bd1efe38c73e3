"""One run, end to end: build, (resume,) train, evaluate, record.  Shared by petl-run and Python.

Protocol (VTAB-1k): decisions are made on val only; the test split is evaluated once, after the
final epoch, so no choice can ever be made on test accuracy.  ``data.split=train800val200`` trains
on all 1,000 examples and has no val split.

Files in ``output_dir``: ``config.yaml`` (resolved, at start), ``metrics.jsonl`` (one line per
epoch), ``checkpoint.pt`` (each epoch, removed at the end unless ``train.keep_checkpoint``),
``trainable.safetensors`` and finally ``result.json``, whose presence marks a finished run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from timm.data import resolve_data_config
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

import petl
from petl import data as petl_data
from petl.core import trainable_state
from petl.run import cache, config, engine, records
from petl.run.config import ConfigError
from petl.run.engine import NonFiniteLossError, build_optimizer, evaluate, fit

log = logging.getLogger(__name__)

# Keys that do not change what a run computes: a resumed run may differ in these.
_NEUTRAL_KEYS = (
    "output_dir",
    "resume",
    "train.progress",
    "train.trackers",
    "train.keep_checkpoint",
    "train.eval_batch_size",
    "data.root",
    "data.num_workers",
)

# The subset of a split that ``data.subset`` keeps is drawn with this fixed seed, so every run
# seed and every method sees the same examples.
_SUBSET_SEED = 20240601


class RunError(RuntimeError):
    """A run could not complete (non-finite loss, unreachable data or weights); the message says why."""


class EpochSampler(Sampler[int]):
    """Shuffles with an order drawn from (seed, epoch) alone.

    Unlike a sampler fed by one running generator, epoch ``e``'s order does not depend on the
    epochs before it, so a run resumed at epoch ``e`` sees exactly the batches it would have seen.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the order of epoch ``epoch``."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        yield from np.random.default_rng([self.seed, self.epoch]).permutation(self.size).tolist()

    def __len__(self) -> int:
        return self.size


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


def _fingerprint(resolved: dict[str, Any]) -> dict[str, Any]:
    """The part of a resolved config that decides what a run computes."""
    flat = _flatten(resolved)
    nested = tuple(f"{key}." for key in _NEUTRAL_KEYS)
    return {key: value for key, value in flat.items() if key not in _NEUTRAL_KEYS and not key.startswith(nested)}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:3]) + (" ..." if len(keys) > 3 else "")


def _prepare_output_dir(out: Path, cfg: DictConfig, fingerprint: dict[str, Any], is_main: bool) -> dict | None:
    """Check what an earlier run left in ``out``; return its result if it finished with this config."""
    if not cfg.resume:
        if is_main:
            for name in records.RUN_FILES:
                (out / name).unlink(missing_ok=True)
        return None
    finished = records.read_json(out / records.RESULT_FILE)
    if finished is not None:
        previous = finished["config"]
    elif (out / records.CHECKPOINT_FILE).exists() and (out / records.CONFIG_FILE).exists():
        previous = OmegaConf.to_container(OmegaConf.load(out / records.CONFIG_FILE))
    else:
        # Nothing finished and no epoch to resume: whatever is there gets overwritten.
        return None
    old = _fingerprint(previous)
    if old != fingerprint:
        raise ConfigError(
            f"output_dir {out} holds a run with another config ({_difference(old, fingerprint)}); "
            "choose another output_dir, or resume=false to replace it"
        )
    return finished


def _make_accelerator(cfg: DictConfig, out: Path) -> Accelerator:
    # One process may run many trainings (notebooks, the benchmark harness): accelerate keeps its
    # precision and accumulation settings in process-wide singletons that refuse to change once
    # set, so each run starts them afresh.  The distributed state (PartialState) is kept.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    trackers = list(cfg.train.trackers)
    precision = cfg.train.precision
    if precision == "fp16" and PartialState().device.type == "cpu":
        # accelerate would accept it and silently run in fp32; say so, and record what really ran.
        log.warning("train.precision=fp16 needs a GPU: running in full precision on the CPU (bf16 works there)")
        precision = "no"
    if precision == "bf16" and PartialState().device.type == "cpu" and not engine.cpu_supports_bf16():
        # accelerate would autocast anyway, through slow emulated bf16 matmuls; result.json records "no".
        log.warning("train.precision=bf16: this CPU has no bf16 instructions (AVX512-BF16/AMX): running in fp32")
        precision = "no"
    # train.compile goes through accelerate's dynamo plugin, which compiles the model in prepare().
    dynamo = "inductor" if cfg.train.compile else None
    missing = engine.compiler_missing(PartialState().device.type) if cfg.train.compile else None
    if missing:
        log.warning("train.compile: %s; running uncompiled", missing)
        dynamo = None
    try:
        return Accelerator(
            mixed_precision=precision,
            dynamo_backend=dynamo,
            gradient_accumulation_steps=cfg.train.grad_accum,
            log_with=trackers or None,
            project_dir=str(out),
        )
    except ValueError as error:  # e.g. bf16 on a GPU without bf16 support
        raise ConfigError(f"train.precision={precision}: {error}") from None


def _create_model(cfg: DictConfig, num_classes: int) -> nn.Module:
    m = cfg.model
    kwargs: dict[str, Any] = dict(OmegaConf.to_container(m.kwargs, resolve=True))
    if m.checkpoint:
        if not Path(m.checkpoint).is_file():
            raise ConfigError(f"model.checkpoint={m.checkpoint}: no such file")
        if not m.pretrained:
            raise ConfigError("model.checkpoint is set but model.pretrained=false: the file would be ignored")
        kwargs["pretrained_cfg_overlay"] = {"file": str(m.checkpoint)}
    try:
        model = timm.create_model(m.name, pretrained=m.pretrained, drop_path_rate=m.drop_path, **kwargs)
    except TypeError as error:
        raise ConfigError(f"model.kwargs: {error}") from None
    except Exception as error:  # timm/hub raise many kinds (RuntimeError, OSError, HTTP errors...)
        if not m.pretrained:
            raise
        text = str(error).strip()
        first = text.splitlines()[0] if text else f"{type(error).__name__} (no weights file)"
        raise RunError(
            f"cannot load pretrained weights of {m.name}: {first}. Give a local file with model.checkpoint=PATH, "
            "or train from random init with model.pretrained=false"
        ) from None
    options = config.method_options(cfg)
    try:
        method_cfg = petl.make_config(cfg.method.name, num_classes=num_classes, **options)
        petl.apply(model, cfg.method.name, config=method_cfg)
    except ValueError as error:
        raise ConfigError(f"method {cfg.method.name}: {error}") from None
    return model


def _subset(dataset: Dataset, size: int | None) -> Dataset:
    if size is None or size >= len(dataset):
        return dataset
    keep = np.sort(np.random.default_rng(_SUBSET_SEED).permutation(len(dataset))[:size])
    return Subset(dataset, keep.tolist())


def _datasets(cfg: DictConfig, model: nn.Module) -> dict[str, Dataset]:
    """Train / val (when the split has one) / test, preprocessed as the backbone expects."""
    data_cfg = resolve_data_config({}, model=model)
    image = dict(image_size=int(data_cfg["input_size"][-1]), mean=data_cfg["mean"], std=data_cfg["std"])
    splits = {"train": cfg.data.split, "test": "test"}
    if cfg.data.split == "train800":
        splits["val"] = "val200"
    built = {}
    for role, split in splits.items():
        try:
            dataset = petl_data.build_dataset(cfg.data.name, split, root=cfg.data.root, **image)
        except petl_data.DatasetUnavailableError as error:
            raise RunError(str(error)) from None
        except ValueError as error:
            raise ConfigError(f"data {cfg.data.name}: {error}") from None
        built[role] = _subset(dataset, cfg.data.subset)
    return built


def _loader(
    dataset: Dataset, batch_size: int, num_workers: int, seed: int, sampler: Sampler | None = None
) -> DataLoader:
    # A loader of its own generator: every DataLoader iterator draws a worker base seed, and drawing
    # it from the global RNG would shift the stream that dropout and drop-path use.
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers, generator=generator)


def _summary_line(result: dict[str, Any]) -> str:
    val = "-" if result["val_top1"] is None else f"{result['val_top1']:.2f}"
    return (
        f"{result['method']} on {result['dataset']} ({result['model']}, seed {result['seed']}): "
        f"val {val}  test {result['test_top1']:.2f}  | {result['trainable_params']:,} trainable params "
        f"| {result['train_seconds']:.0f} s"
    )


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run a composed, checked config (:func:`train` completes and checks one first)."""
    config.check_values(cfg)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as error:
        raise ConfigError(config.explain(error)) from None
    assert isinstance(resolved, dict)
    out = Path(cfg.output_dir)
    fingerprint = _fingerprint(resolved)
    finished = _prepare_output_dir(out, cfg, fingerprint, is_main=_is_main_process())
    if finished is not None:
        if _is_main_process():
            log.info("already finished: %s", _summary_line(finished))
        return finished

    accelerator = _make_accelerator(cfg, out)
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    if cfg.train.deterministic and accelerator.device.type == "cpu":
        # warn_only: an op without a deterministic kernel warns instead of stopping the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _run(cfg, resolved, out, accelerator)
    finally:
        torch.use_deterministic_algorithms(deterministic_before)
        if cfg.train.trackers:
            accelerator.end_training()


def _is_main_process() -> bool:
    # Read before accelerate is set up (the launcher exports RANK to every process).
    return os.environ.get("RANK", "0") == "0"


def _run(cfg: DictConfig, resolved: dict[str, Any], out: Path, accelerator: Accelerator) -> dict[str, Any]:
    started = time.perf_counter()
    # Every process runs this function; one of them talks.
    say = log.info if accelerator.is_main_process else lambda *args: None
    set_seed(cfg.seed)
    info = petl_data.get_info(cfg.data.name)
    model = _create_model(cfg, info.num_classes)
    if cfg.train.grad_checkpointing:
        engine.enable_grad_checkpointing(model)
    datasets = _datasets(cfg, model)
    model.to(accelerator.device)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()

    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        records.write_text(out / records.CONFIG_FILE, OmegaConf.to_yaml(resolved))

    settings = config.settings_from(cfg)
    settings = dataclasses.replace(settings, progress=settings.progress and accelerator.is_main_process)
    num_workers = cfg.data.num_workers
    cache_plan = cache.plan(model) if cfg.train.cache_features else None
    train_set, val_set = datasets["train"], datasets.get("val")
    if cache_plan is not None and not cache.fits(model, cache_plan, [len(d) for d in (train_set, val_set) if d]):
        say("not caching features: the cache would exceed %d GiB", cache.MAX_CACHE_BYTES // 2**30)
        cache_plan = None
    trainee: nn.Module = model
    tick = time.perf_counter()
    if cache_plan is not None:
        trainee = cache.CachedTail(model, cache_plan)
        batch = cfg.train.eval_batch_size
        train_set = cache.cache_split(trainee, train_set, accelerator, batch, num_workers)
        val_set = cache.cache_split(trainee, val_set, accelerator, batch, num_workers) if val_set else None
        seconds = time.perf_counter() - tick
        say("cached %s of %d train images in %.1f s", cache_plan.describe(), len(train_set), seconds)

    sampler = EpochSampler(len(train_set), cfg.seed)
    train_loader = _loader(train_set, cfg.train.batch_size, num_workers, cfg.seed, sampler)
    eval_loaders = {"val": _loader(val_set, cfg.train.eval_batch_size, num_workers, cfg.seed)} if val_set else {}
    test_loader = _loader(datasets["test"], cfg.train.eval_batch_size, num_workers, cfg.seed)
    # The schedule counts optimizer steps: one per grad_accum batches (accelerate steps the
    # scheduler once per process per call, which adds up to this count under DDP too).
    steps_per_epoch = math.ceil(len(train_loader) / cfg.train.grad_accum)
    optimizer, scheduler = build_optimizer(trainee, settings, steps_per_epoch)
    trainee, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        trainee, optimizer, train_loader, test_loader, scheduler
    )
    eval_loaders = {name: accelerator.prepare(loader) for name, loader in eval_loaders.items()}

    history: list[dict[str, Any]] = []
    seconds_before = 0.0
    start_epoch = 0
    checkpoint = records.load_checkpoint(out / records.CHECKPOINT_FILE) if cfg.resume else None
    if checkpoint is not None:
        # _prepare_output_dir has already matched this checkpoint's config.yaml against cfg.
        _load_trainable(model, checkpoint["trainable"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        records.set_rng_state(checkpoint["rng"])
        start_epoch, history, seconds_before = checkpoint["epoch"], checkpoint["history"], checkpoint["seconds"]
        say("resuming %s from epoch %d/%d", out, start_epoch, settings.epochs)
    if accelerator.is_main_process:
        records.write_metrics(out / records.METRICS_FILE, history)
    if cfg.train.trackers:
        accelerator.init_trackers("petl", config=_scalars(_flatten(resolved)))
    # Training time counts the cache once: a resumed session's caching was paid by the first session.
    session_start = time.perf_counter() if checkpoint is not None else tick

    def on_epoch_end(epoch: int, metrics: dict[str, float]) -> None:
        history.append(metrics)
        if accelerator.is_main_process:
            state = {
                "epoch": epoch + 1,
                "trainable": {k: v.cpu() for k, v in trainable_state(model).items()},
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": records.rng_state(),
                "history": history,
                "seconds": seconds_before + time.perf_counter() - session_start,
            }
            # Checkpoint first, then the metrics line: a crash in between leaves a line too few,
            # and a resume rewrites metrics.jsonl from the checkpoint's history anyway.
            records.save_checkpoint(out / records.CHECKPOINT_FILE, state)
            records.append_metrics(out / records.METRICS_FILE, metrics)
        accelerator.wait_for_everyone()
        val = f"  val {metrics['val_top1']:.2f}" if "val_top1" in metrics else ""
        say(
            "epoch %d/%d  loss %.4f  train %.2f%s  %.0f img/s",
            epoch + 1,
            settings.epochs,
            metrics["loss"],
            metrics["train_top1"],
            val,
            metrics["images_per_second"],
        )
        if cfg.train.trackers:
            accelerator.log(metrics, step=epoch + 1)

    try:
        fit(trainee, train_loader, eval_loaders, settings, accelerator, optimizer, scheduler, start_epoch, on_epoch_end)
    except NonFiniteLossError as error:
        kept = f"the checkpoint of epoch {len(history)} is kept" if history else "no epoch had finished"
        raise RunError(
            f"{error}: training stopped ({kept}); lower train.lr (with resume=false) or check the data"
        ) from None
    train_seconds = seconds_before + time.perf_counter() - session_start

    # Without the compile wrapper: a CachedTail is swapped for the whole model to test on images.
    full_model = accelerator.unwrap_model(trainee, keep_torch_compile=False)
    full_model = full_model.model if isinstance(full_model, cache.CachedTail) else full_model
    test_top1 = evaluate(full_model, test_loader, accelerator)
    peak_mb, peak_kind = records.peak_memory()
    result = _result(cfg, model, info.num_classes, history, test_top1, train_seconds, cache_plan, accelerator)
    result.update(peak_memory_mb=round(peak_mb, 1), peak_memory_kind=peak_kind, config=resolved)
    result["wall_seconds"] = round(time.perf_counter() - started, 2)
    if accelerator.is_main_process:
        records.write_atomic(out / records.WEIGHTS_FILE, lambda tmp: petl.save_trainable(model, tmp))
        records.write_json(out / records.RESULT_FILE, result)
        if not cfg.train.keep_checkpoint:
            (out / records.CHECKPOINT_FILE).unlink(missing_ok=True)
    accelerator.wait_for_everyone()
    say("wrote %s", out / records.RESULT_FILE)
    return result


def _load_trainable(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def _scalars(flat: dict[str, Any]) -> dict[str, Any]:
    # Trackers (TensorBoard hparams) accept scalars and strings only.
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()}


def _result(
    cfg: DictConfig,
    model: nn.Module,
    num_classes: int,
    history: list[dict[str, Any]],
    test_top1: float,
    train_seconds: float,
    cache_plan: cache.CachePlan | None,
    accelerator: Accelerator,
) -> dict[str, Any]:
    counts = petl.count_params(model)
    images = sum(h["images"] for h in history)
    seconds = sum(h["seconds"] for h in history)
    last = history[-1] if history else {}
    val_history = [h["val_top1"] for h in history if "val_top1" in h]
    return {
        "method": cfg.method.name,
        "method_config": dataclasses.asdict(model.petl_config),
        "dataset": cfg.data.name,
        "split": cfg.data.split,
        "model": cfg.model.name,
        "pretrained": cfg.model.pretrained,
        "seed": cfg.seed,
        "num_classes": num_classes,
        "trainable_params": counts.trainable,
        "trainable_params_no_head": counts.trainable_no_head,
        "total_params": counts.total,
        "val_top1": last.get("val_top1"),
        "best_val_top1": max(val_history) if val_history else None,
        "test_top1": test_top1,
        "final_train_loss": last.get("loss"),
        "final_train_top1": last.get("train_top1"),
        "epochs": cfg.train.epochs,
        "train_seconds": round(train_seconds, 2),
        "images_per_second": round(images / seconds, 1) if seconds else None,
        "feature_cache": cache_plan.describe() if cache_plan else None,
        "device": str(accelerator.device),
        "num_processes": accelerator.num_processes,
        "precision": accelerator.mixed_precision,
        "effective_batch_size": cfg.train.batch_size * accelerator.num_processes * cfg.train.grad_accum,
        "versions": records.versions(),
        **records.git_commit(),
        "output_dir": str(cfg.output_dir),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
