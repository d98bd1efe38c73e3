"""One run, end to end: build, (resume,) train, evaluate, record.  Shared by petl-run and Python.

Protocol (VTAB-1k): decisions are made on val only; the test split is evaluated once, after the
final epoch, so no choice can ever be made on test accuracy.  ``data.split=train800val200`` trains
on all 1,000 examples and has no val split.

Files in ``output_dir``: ``config.yaml`` (resolved, at start), ``metrics.jsonl`` (one line per
epoch), ``checkpoint.pt`` (each epoch, removed at the end unless ``train.keep_checkpoint``),
``trainable.safetensors`` and finally ``result.json``, whose presence marks a finished run.  While a
run goes on, ``.petl.lock`` (:mod:`petl.run.lock`) keeps a second run out of the folder.

Steps of :func:`_run`: build the model, build the data, check a resume against the data and weights
files, prepare the loaders (over cached features where the method allows) and optimizer, restore the
checkpoint, train, evaluate test once, record.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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
from petl.run import cache, config, engine, lock, records
from petl.run.config import ConfigError
from petl.run.engine import NonFiniteLossError, TrainSettings, backbone_mode, build_optimizer, evaluate, fit

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
    # Neutral for the order, dropout and drop-path; with augmented images (FGVC) the crops come from the global
    # stream with 0 workers and from per-epoch worker seeds with more, so changing it mid-run changes the crops.
    "data.num_workers",
)

# The subset of a split that ``data.subset`` keeps is drawn with this fixed seed, so every run
# seed and every method sees the same examples.
_SUBSET_SEED = 20240601


class RunError(RuntimeError):
    """A run could not complete (non-finite loss, unreachable data or weights); the message says why."""


class DivergedError(RunError):
    """The loss became NaN or infinite: this configuration diverged.

    In an lr search that is an outcome, not a breakdown: the selection protocol scores such a trial last
    (it checks ``diverged`` rather than the class, so the sweep need not import the engine).
    """

    diverged = True


class EpochSampler(Sampler[int]):
    """Shuffles with an order drawn from (seed, epoch) alone.

    Unlike a sampler fed by one running generator, epoch ``e``'s order does not depend on the
    epochs before it, so a run resumed at epoch ``e`` sees exactly the batches it would have seen.
    ``generator`` (the training DataLoader's) is reseeded from (seed, epoch) too: each epoch's
    iterator draws its worker base seed from it, and with ``num_workers > 0`` the workers' random
    crops and flips come from that seed, so a resumed epoch gets its own, not epoch 0's.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = seed
        self.epoch = 0
        self.generator = torch.Generator()
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Select the order (and the loader's worker seeds) of epoch ``epoch``."""
        self.epoch = epoch
        self.generator.manual_seed(int(np.random.SeedSequence([self.seed, epoch]).generate_state(1)[0]))

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
    elif (out / records.CHECKPOINT_FILE).exists():
        if not (out / records.CONFIG_FILE).exists():
            # config.yaml is written before the first checkpoint, so only a deleted file gets here (by hand, or a
            # copy of the folder that kept only git-ignored files); without it nothing tells which config the
            # checkpoint was trained with, and resuming could mix two.
            raise ConfigError(
                f"output_dir {out} holds {records.CHECKPOINT_FILE} without its {records.CONFIG_FILE}, so its config "
                "cannot be checked; choose another output_dir, or resume=false to replace it"
            )
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
    if finished is not None:
        # The dataset's content fingerprint needs the dataset built; a finished run is compared on
        # what is known without that (data.root, the model file), so a changed folder is refused.
        _check_inputs(out, finished.get("inputs"), _inputs(cfg, None), finished=True)
        if is_main and not cfg.train.keep_checkpoint:
            # Left by a kill between result.json and the checkpoint's removal.
            (out / records.CHECKPOINT_FILE).unlink(missing_ok=True)
    return finished


def check_finished(cfg: DictConfig) -> None:
    """Refuse a finished run in ``cfg.output_dir`` that was trained with another config or other inputs.

    A sweep skips a run whose ``result.json`` exists without calling :func:`run`; this is the same check
    :func:`run` makes before returning such a result, so an edited suite (another epoch count, say) cannot
    have old results counted as its own.

    Raises:
        ConfigError: the folder holds a run of another config, data folder or weights file.

    """
    finished = records.read_json(Path(cfg.output_dir) / records.RESULT_FILE)
    if finished is None or "config" not in finished:
        return  # nothing finished here (or a hand-made record): nothing to compare
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    old, new = _fingerprint(finished["config"]), _fingerprint(resolved)
    # A key added to petl after the run finished is not a difference: an option is added with a default that
    # keeps the old behaviour, so committed results stay valid when petl grows an option.
    new = {k: v for k, v in new.items() if k in old}
    if old != new:
        raise ConfigError(
            f"output_dir {cfg.output_dir} holds a run with another config ({_difference(old, new)}); "
            "delete it to train this config"
        )
    _check_inputs(Path(cfg.output_dir), finished.get("inputs"), _inputs(cfg, None), finished=True)


def _inputs(cfg: DictConfig, dataset: Dataset | None) -> dict[str, Any]:
    """What decides a run's result besides its config values: the data and weights files' content.

    ``data.root`` may move without changing anything (it is not part of :func:`_fingerprint`), so a
    dataset's content ``fingerprint`` (datasets read from local folders carry one) is what counts
    when there is one; without it, the resolved folder is compared instead.
    """
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    root = cfg.data.root
    checkpoint = cfg.model.checkpoint if cfg.model.pretrained else None
    if checkpoint and not Path(checkpoint).is_file():
        raise ConfigError(f"model.checkpoint={checkpoint}: no such file")
    return {
        "data.root": str(Path(root).expanduser().resolve()) if root else None,
        "data.fingerprint": getattr(dataset, "fingerprint", None),
        "model.checkpoint_sha256": records.file_sha256(Path(checkpoint)) if checkpoint else None,
    }


def _check_inputs(out: Path, old: dict[str, Any] | None, new: dict[str, Any], finished: bool = False) -> None:
    """Refuse to resume (or to return a finished result) when the data or weights changed."""
    if old is None:
        return  # recorded by a petl from before inputs were recorded
    keys = ["model.checkpoint_sha256"]
    if finished or old.get("data.fingerprint") is None or new.get("data.fingerprint") is None:
        keys.append("data.root")
    if not finished:
        keys.append("data.fingerprint")
    changed = {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}
    if changed:
        what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
        done = "a finished run" if finished else "epochs trained"
        raise ConfigError(
            f"output_dir {out} holds {done} on other inputs ({what}); "
            "choose another output_dir, or resume=false to replace it"
        )


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


def _create_backbone(cfg: DictConfig) -> nn.Module:
    """The pretrained (or randomly initialised) timm model, before any method is applied."""
    m = cfg.model
    kwargs: dict[str, Any] = dict(OmegaConf.to_container(m.kwargs, resolve=True))
    if m.checkpoint:
        if not Path(m.checkpoint).is_file():
            raise ConfigError(f"model.checkpoint={m.checkpoint}: no such file")
        if not m.pretrained:
            raise ConfigError("model.checkpoint is set but model.pretrained=false: the file would be ignored")
        kwargs["pretrained_cfg_overlay"] = {"file": str(m.checkpoint)}
    try:
        return timm.create_model(m.name, pretrained=m.pretrained, drop_path_rate=m.drop_path, **kwargs)
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


def _method_config(
    cfg: DictConfig,
    backbone: nn.Module,
    num_classes: int,
    checkpoint: dict[str, Any] | None,
    accelerator: Accelerator,
) -> petl.MethodConfig:
    """The method's config: from the command line, completed by the method's ``calibrate`` hook if it has one.

    A resumed run takes the config its checkpoint recorded, so the weights it restores fit the
    modules they were trained in even if calibrating again would choose differently.
    """
    name = cfg.method.name
    spec = petl.get_method(name)
    recorded = checkpoint.get("method_config") if checkpoint is not None else None
    options = recorded if recorded is not None else {"num_classes": num_classes, **config.method_options(cfg)}
    try:
        method_cfg = petl.make_config(name, **options)
    except ValueError as error:
        raise ConfigError(f"method {name}: {error}") from None
    if recorded is not None or spec.calibrate is None:
        return method_cfg
    tick = time.perf_counter()
    dataset = _calibration_set(cfg, backbone)
    loader = _loader(dataset, cfg.train.eval_batch_size, cfg.data.num_workers, cfg.seed)
    try:
        method_cfg = spec.calibrate(backbone.to(accelerator.device), method_cfg, loader)
    except ValueError as error:
        raise RunError(f"method {name}: calibrating on the train split failed: {error}") from None
    _say(accelerator, "calibrated %s on %d train images in %.1f s", name, len(dataset), time.perf_counter() - tick)
    return method_cfg


def _apply_method(cfg: DictConfig, model: nn.Module, method_cfg: petl.MethodConfig) -> None:
    try:
        petl.apply(model, cfg.method.name, config=method_cfg)
    except ValueError as error:
        raise ConfigError(f"method {cfg.method.name}: {error}") from None


def _subset(dataset: Dataset, size: int | None) -> Dataset:
    if size is None or size >= len(dataset):
        return dataset
    keep = np.sort(np.random.default_rng(_SUBSET_SEED).permutation(len(dataset))[:size])
    return Subset(dataset, keep.tolist())


def _image_options(cfg: DictConfig, model: nn.Module) -> dict[str, Any]:
    """How the backbone expects its images (timm pretrained config), and the task's augmentation setting."""
    data_cfg = resolve_data_config({}, model=model)
    return dict(
        image_size=int(data_cfg["input_size"][-1]),
        mean=data_cfg["mean"],
        std=data_cfg["std"],
        # The backbone's own resampling filter; FGVC's crop-and-flip protocol unless data.augment says otherwise.
        interpolation=data_cfg["interpolation"],
        augment=cfg.data.augment,
    )


def _build_split(cfg: DictConfig, split: str, image: dict[str, Any]) -> Dataset:
    try:
        dataset = petl_data.build_dataset(cfg.data.name, split, root=cfg.data.root, **image)
    except (petl_data.DatasetUnavailableError, petl_data.BadImagesError) as error:
        # Bad image files are a data fault, not a config error; the message names the dataset and every path.
        raise RunError(str(error)) from None
    except ValueError as error:
        raise ConfigError(f"data {cfg.data.name}: {error}") from None
    return _subset(dataset, cfg.data.subset)


def _datasets(cfg: DictConfig, model: nn.Module) -> dict[str, Dataset]:
    """Train / val (when the split has one) / test, preprocessed as the backbone expects."""
    image = _image_options(cfg, model)
    splits = {"train": cfg.data.split}
    if cfg.train.eval_test:
        splits["test"] = petl_data.TEST
    if cfg.data.split == petl_data.TRAIN:
        splits["val"] = petl_data.VAL
    return {role: _build_split(cfg, split, image) for role, split in splits.items()}


def _calibration_set(cfg: DictConfig, model: nn.Module) -> Dataset:
    """The training split (the same examples) with the evaluation transform: no random crop or flip."""
    return _build_split(cfg, cfg.data.split, {**_image_options(cfg, model), "eval_transform": True})


def _is_augmented(dataset: Dataset) -> bool:
    """Whether ``dataset`` draws a new random crop and flip at every access (FGVC's training transform)."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    spec = getattr(dataset, "spec", None)
    return bool(getattr(spec, "augment", False))


def _loader(
    dataset: Dataset,
    batch_size: int,
    num_workers: int,
    seed: int,
    sampler: Sampler | None = None,
    drop_last: bool = False,
) -> DataLoader:
    # A loader of its own generator: every DataLoader iterator draws a worker base seed, and drawing
    # it from the global RNG would shift the stream that dropout and drop-path use.  The training
    # loader takes its EpochSampler's, which is reseeded every epoch.
    generator = getattr(sampler, "generator", None) or torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        generator=generator,
        drop_last=drop_last,
    )


def summary_line(result: dict[str, Any]) -> str:
    """One line for the console: method, task, accuracies, trainable parameters, time."""
    val = "-" if result["val_top1"] is None else f"{result['val_top1']:.2f}"
    test = "-" if result["test_top1"] is None else f"{result['test_top1']:.2f}"
    return (
        f"{result['method']} on {result['dataset']} ({result['model']}, seed {result['seed']}): "
        f"val {val}  test {test}  | {result['trainable_params']:,} trainable params "
        f"| {result['train_seconds']:.0f} s"
    )


def run(cfg: DictConfig, *, checked: bool = False) -> dict[str, Any]:
    """Run a composed config (:func:`train` completes and checks one first).

    Args:
        cfg: a composed run config.
        checked: ``cfg`` comes from :func:`petl.run.config.default_config` unchanged (petl-run's
            own path), so its values are not checked a second time.

    """
    if not checked:
        config.check_values(cfg)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as error:
        raise ConfigError(config.explain(error)) from None
    assert isinstance(resolved, dict)
    out = Path(cfg.output_dir)
    with _claim(out):
        finished = _prepare_output_dir(out, cfg, _fingerprint(resolved), is_main=records.is_main_process())
        if finished is not None:
            if records.is_main_process():
                log.info("already finished: %s", summary_line(finished))
            return finished

        accelerator = _make_accelerator(cfg, out)
        deterministic_before = torch.are_deterministic_algorithms_enabled()
        benchmark_before = torch.backends.cudnn.benchmark
        # warn_only: an op without a deterministic kernel warns instead of stopping the run.
        torch.use_deterministic_algorithms(cfg.train.deterministic, warn_only=True)
        if cfg.train.deterministic and accelerator.device.type == "cuda":
            # cuBLAS repeats its results only with a fixed workspace, read when cuBLAS starts (torch's
            # reproducibility notes); set here, it acts unless this process already ran a CUDA matmul.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False
        try:
            return _run(cfg, resolved, out, accelerator)
        finally:
            torch.use_deterministic_algorithms(deterministic_before)
            torch.backends.cudnn.benchmark = benchmark_before
            if cfg.train.trackers:
                accelerator.end_training()


@contextmanager
def _claim(out: Path) -> Iterator[None]:
    """Hold ``out`` for this run: checked writable, locked, cleared of litter; left as found on failure.

    Only the main process claims (the others of a multi-GPU launch write nothing).  A folder this
    claim created is removed again if the run fails before writing anything into it.
    """
    if not records.is_main_process():
        yield
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {out} is a file, not a folder: choose another output_dir")
    created = [p for p in (out, *out.parents) if not p.exists()]
    # A sweep (petl-bench) holds the folder's lock itself and trains in this very process.
    ours = not lock.holds_lock(out)
    try:
        taken = lock.acquire_lock(out) if ours else True
    except OSError as error:
        _remove_empty(created)
        reason = error.strerror or str(error)
        raise ConfigError(f"output_dir {out} cannot be written ({reason}): choose another output_dir") from None
    if not taken:
        raise RunError(
            f"output_dir {out} is in use by another run ({lock.describe_holder(out)}); wait for it to finish "
            f"or choose another output_dir (delete {out / lock.LOCK_FILE} if that process is gone)"
        )
    for tmp in records.temporary_files(out):  # left by a kill during an atomic write
        tmp.unlink(missing_ok=True)
    try:
        yield
    finally:
        if ours:
            lock.release_lock(out)
        _remove_empty(created)


def _remove_empty(created: list[Path]) -> None:
    """Remove the folders of ``created`` (deepest first) that are still empty."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:  # not empty (the run wrote something), or already gone
            return


@contextmanager
def _disk_errors(out: Path, saved_epoch: Callable[[], int], resume: bool = True) -> Iterator[None]:
    """Turn a failed write (disk full, folder gone) into one line saying which epochs are safe."""
    try:
        yield
    except OSError as error:
        epoch = saved_epoch()
        kept = f"the checkpoint of epoch {epoch} is kept" if epoch else "no epoch had finished"
        reason = error.strerror or str(error)
        # With resume=false the same command would delete the kept checkpoint and start over.
        again = "run the same command again to resume" if resume else "run the command again with resume=true"
        raise RunError(f"cannot write to output_dir {out} ({reason}): {kept}; free the space and {again}") from None


def _run(cfg: DictConfig, resolved: dict[str, Any], out: Path, accelerator: Accelerator) -> dict[str, Any]:
    """The protocol: build, check the resume, train, evaluate test once, record."""
    started = time.perf_counter()
    set_seed(cfg.seed)
    info = petl_data.get_info(cfg.data.name)
    model = _create_backbone(cfg)
    datasets = _datasets(cfg, model)
    inputs = _inputs(cfg, datasets["train"])
    checkpoint = _resume_checkpoint(out, cfg, inputs)
    method_cfg = _method_config(cfg, model, info.num_classes, checkpoint, accelerator)
    _apply_method(cfg, model, method_cfg)
    if cfg.train.grad_checkpointing:
        engine.enable_grad_checkpointing(model)
    model.to(accelerator.device)
    # Every run's peak is its own, also when runs share a process (Hydra's in-process --multirun, a notebook).
    records.reset_peak_rss()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    progress = _Progress.start(checkpoint)
    with _disk_errors(out, lambda: progress.saved_epoch, cfg.resume):
        if accelerator.is_main_process:
            records.write_text(out / records.CONFIG_FILE, OmegaConf.to_yaml(resolved))
    training = _prepare_training(cfg, model, datasets, accelerator)
    if checkpoint is not None:
        training.restore(checkpoint)
        _say(accelerator, "resuming %s from epoch %d/%d", out, progress.start_epoch, cfg.train.epochs)
    with _disk_errors(out, lambda: progress.saved_epoch, cfg.resume):
        if accelerator.is_main_process:
            records.write_metrics(out / records.METRICS_FILE, progress.history)
    if cfg.train.trackers:
        accelerator.init_trackers("petl", config=_scalars(_flatten(resolved)))
    # Training time counts the cache once: a resumed session's caching was paid by the first session.
    progress.session_start = time.perf_counter() if checkpoint is not None else training.tick
    _train(cfg, out, training, progress, inputs)
    # Read before the test pass: train_seconds is what training cost (a trial, which never tests, and a final run
    # then count alike); the test pass is recorded on its own.
    train_seconds = progress.seconds()
    tested = time.perf_counter()
    test_top1 = _evaluate_test_once(training)
    result = _result(cfg, model, info.num_classes, progress.history, test_top1, train_seconds, training)
    result["test_seconds"] = round(time.perf_counter() - tested, 2) if test_top1 is not None else None
    peak_mb, peak_kind = records.peak_memory()
    result.update(peak_memory_mb=round(peak_mb, 1), peak_memory_kind=peak_kind, config=resolved, inputs=inputs)
    result["wall_seconds"] = round(time.perf_counter() - started, 2)
    with _disk_errors(out, lambda: progress.saved_epoch, cfg.resume):
        _record(cfg, out, model, result, accelerator)
    _say(accelerator, "wrote %s", out / records.RESULT_FILE)
    return result


def _say(accelerator: Accelerator, message: str, *args: Any) -> None:
    # Every process runs the training; one of them talks.
    if accelerator.is_main_process:
        log.info(message, *args)


def _resume_checkpoint(out: Path, cfg: DictConfig, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint to resume from, once its data and weights are known to be this run's."""
    checkpoint = records.load_checkpoint(out / records.CHECKPOINT_FILE) if cfg.resume else None
    if checkpoint is not None:
        # _prepare_output_dir has matched its config.yaml against cfg; the inputs need the data built.
        _check_inputs(out, checkpoint.get("inputs"), inputs)
    return checkpoint


@dataclass
class _Progress:
    """Where training stands: epochs done, their metrics, time spent, the last epoch saved to disk."""

    start_epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    seconds_before: float = 0.0
    saved_epoch: int = 0
    session_start: float = 0.0

    @classmethod
    def start(cls, checkpoint: dict[str, Any] | None) -> _Progress:
        if checkpoint is None:
            return cls()
        epoch = checkpoint["epoch"]
        return cls(epoch, checkpoint["history"], checkpoint["seconds"], saved_epoch=epoch)

    def seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.session_start


@dataclass
class _Training:
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

    def restore(self, checkpoint: dict[str, Any]) -> None:
        """Continue from a checkpoint: weights, optimizer, schedule and every random generator."""
        # trainable_state also holds buffers of trained modules (BatchNorm statistics in Mlp-k's head).
        params = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        with torch.no_grad():
            for name, tensor in checkpoint["trainable"].items():
                params[name].copy_(tensor)
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        if checkpoint.get("scaler") is not None and self.accelerator.scaler is not None:
            self.accelerator.scaler.load_state_dict(checkpoint["scaler"])
        records.set_rng_state(checkpoint["rng"])


def _prepare_training(
    cfg: DictConfig, model: nn.Module, datasets: dict[str, Dataset], accelerator: Accelerator
) -> _Training:
    """Loaders (over cached features where the method allows), optimizer and schedule, prepared."""
    settings = config.settings_from(cfg)
    settings = dataclasses.replace(settings, progress=settings.progress and accelerator.is_main_process)
    num_workers = cfg.data.num_workers
    cache_plan = cache.plan(model) if cfg.train.cache_features else None
    if cache_plan is not None and backbone_mode(model, settings) == "train":
        # A cached front runs once in eval mode; with the backbone in train mode its dropout and
        # drop-path must act on every step, so nothing can be cached.
        if accelerator.is_main_process:
            log.info("not caching features: train.backbone_mode is train, the frozen front is stochastic")
        cache_plan = None
    train_set, val_set = datasets["train"], datasets.get("val")
    if cache_plan is not None and _is_augmented(train_set):
        # A cached image would be one random crop and flip reused every epoch: the augmentation would be lost.
        _say(accelerator, "not caching features: the training images are augmented (a new crop and flip each epoch)")
        cache_plan = None
    if cache_plan is not None and not cache.fits(model, cache_plan, [len(d) for d in (train_set, val_set) if d]):
        _say(accelerator, "not caching features: the cache would exceed %d GiB", cache.MAX_CACHE_BYTES // 2**30)
        cache_plan = None
    trainee: nn.Module = model
    tick = time.perf_counter()
    if cache_plan is not None:
        trainee = cache.CachedTail(model, cache_plan)
        batch = cfg.train.eval_batch_size
        train_set = cache.cache_split(trainee, train_set, accelerator, batch, num_workers)
        val_set = cache.cache_split(trainee, val_set, accelerator, batch, num_workers) if val_set else None
        seconds = time.perf_counter() - tick
        _say(accelerator, "cached %s of %d train images in %.1f s", cache_plan.describe(), len(train_set), seconds)

    sampler = EpochSampler(len(train_set), cfg.seed)
    # A last training batch of one image cannot be trained in batch statistics (Mlp-k's BatchNorm1d raises on
    # it; KMnP/vpt src/data/loader.py:L53-65 keeps it on one GPU and would fail the same way): that one image
    # is left out of the epoch, a different one each epoch since the order is reshuffled.  No other size drops.
    lone_last = len(train_set) % cfg.train.batch_size == 1
    train_loader = _loader(train_set, cfg.train.batch_size, num_workers, cfg.seed, sampler, drop_last=lone_last)
    eval_loaders = {"val": _loader(val_set, cfg.train.eval_batch_size, num_workers, cfg.seed)} if val_set else {}
    # A selection trial (train.eval_test=false) never builds the test split, let alone scores it.
    test_set = datasets.get("test")
    test_loader = _loader(test_set, cfg.train.eval_batch_size, num_workers, cfg.seed) if test_set is not None else None
    # The schedule counts optimizer steps: one per grad_accum batches (accelerate steps the
    # scheduler once per process per call, which adds up to this count under DDP too).
    steps_per_epoch = math.ceil(len(train_loader) / cfg.train.grad_accum)
    optimizer, scheduler = build_optimizer(trainee, settings, steps_per_epoch)
    trainee, optimizer, train_loader, scheduler = accelerator.prepare(trainee, optimizer, train_loader, scheduler)
    test_loader = accelerator.prepare(test_loader) if test_loader is not None else None
    eval_loaders = {name: accelerator.prepare(loader) for name, loader in eval_loaders.items()}
    return _Training(
        model, trainee, train_loader, eval_loaders, test_loader, optimizer, scheduler, settings, accelerator,
        cache_plan, tick,
    )  # fmt: skip


def _train(cfg: DictConfig, out: Path, training: _Training, progress: _Progress, inputs: dict[str, Any]) -> None:
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
                "rng": records.rng_state(),
                # fp16's loss scale: restarted at its initial value, a resumed run would skip other steps.
                "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
                "history": progress.history,
                "seconds": progress.seconds(),
                "inputs": inputs,
                # What the method's calibrate hook chose: a resume must rebuild the same modules.
                "method_config": dataclasses.asdict(model.petl_config),
            }
            # Checkpoint first, then the metrics line: a crash in between leaves a line too few,
            # and a resume rewrites metrics.jsonl from the checkpoint's history anyway.
            with _disk_errors(out, lambda: progress.saved_epoch, cfg.resume):
                records.save_checkpoint(out / records.CHECKPOINT_FILE, state)
                progress.saved_epoch = epoch + 1
                records.append_metrics(out / records.METRICS_FILE, metrics)
        accelerator.wait_for_everyone()
        val = f"  val {metrics['val_top1']:.2f}" if "val_top1" in metrics else ""
        _say(
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


def _evaluate_test_once(training: _Training) -> float | None:
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


def _record(cfg: DictConfig, out: Path, model: nn.Module, result: dict[str, Any], accelerator: Accelerator) -> None:
    """Weights, then ``result.json`` (its presence marks the run finished), then drop the checkpoint."""
    if accelerator.is_main_process:
        records.write_atomic(out / records.WEIGHTS_FILE, lambda tmp: petl.save_trainable(model, tmp))
        records.write_json(out / records.RESULT_FILE, result)
        if not cfg.train.keep_checkpoint:
            (out / records.CHECKPOINT_FILE).unlink(missing_ok=True)
    accelerator.wait_for_everyone()


def _scalars(flat: dict[str, Any]) -> dict[str, Any]:
    # Trackers (TensorBoard hparams) accept scalars and strings only.
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()}


def _result(
    cfg: DictConfig,
    model: nn.Module,
    num_classes: int,
    history: list[dict[str, Any]],
    test_top1: float | None,
    train_seconds: float,
    training: _Training,
) -> dict[str, Any]:
    accelerator, cache_plan = training.accelerator, training.cache_plan
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
        # What really ran: train.compile falls back to eager (with a warning) where no compiler is found.
        "compiled": accelerator.state.dynamo_plugin.backend.value != "NO",
        "effective_batch_size": cfg.train.batch_size * accelerator.num_processes * cfg.train.grad_accum,
        "versions": records.versions(),
        **records.git_commit(),
        "output_dir": str(cfg.output_dir),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
