"""The parts of a run, built from its config: accelerator, backbone, method config, datasets and loaders.

Each function turns what it cannot build into one line: :class:`ConfigError` for bad input,
:class:`UnreachableError` (a :class:`RunError`) for what is out of reach (weights, data).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import parse_flag_from_env
from omegaconf import DictConfig
from timm.data import resolve_data_config
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

import petl.methods  # noqa: F401  (importing the methods registers them)
from petl import data as petl_data
from petl.data import hub
from petl.data.images import conflicts, copies
from petl.model.registry import MethodConfig, get_method, make_config
from petl.model.surgery import apply, check_supported
from petl.store import run_card
from petl.train import config, engine, output_dir
from petl.train.config import ConfigError
from petl.utils.distributed import is_main_process
from petl.utils.errors import RunError, UnreachableError
from petl.utils.once import warn_main, warn_once
from petl.utils.precision import auto_precision, cpu_supports_bf16, refuse_gpu_only, uses_tf32
from petl.utils.text import first_line

log = logging.getLogger(__name__)

# The subset of a split that ``data.subset`` keeps is drawn with this fixed seed, so every run
# seed and every method sees the same examples.
_SUBSET_SEED = 20240601


class EpochSampler(Sampler[int]):
    """Shuffles with an order drawn from (seed, epoch) alone.

    Unlike a sampler fed by one running generator, epoch ``e``'s order does not depend on the
    epochs before it, so a run resumed at epoch ``e`` sees exactly the batches it would have seen.
    ``generator`` (the training DataLoader's) is reseeded from (seed, epoch) too: each epoch's
    iterator draws its worker base seed from it.  ``dataset``, when it has a ``set_epoch`` (a
    :class:`SeededAugmentation`), is told the epoch as well: its random crops and flips are the epoch's.
    """

    def __init__(self, size: int, seed: int, dataset: Dataset | None = None) -> None:
        self.size = size
        self.seed = seed
        self.epoch = 0
        self.dataset = dataset
        self.generator = torch.Generator()
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Select the order (and the loader's worker seeds, the dataset's crops) of epoch ``epoch``."""
        self.epoch = epoch
        self.generator.manual_seed(int(np.random.SeedSequence([self.seed, epoch]).generate_state(1)[0]))
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        yield from np.random.default_rng([self.seed, self.epoch]).permutation(self.size).tolist()

    def __len__(self) -> int:
        return self.size


class SeededAugmentation(Dataset):
    """A training split whose random crops and flips are drawn from (seed, epoch, index) alone.

    Drawn from torch's global stream they would depend on ``data.num_workers``: with none, on the main
    process's stream (shifting dropout's), with workers, on each worker's seed and the items it happens to
    load.  Each item draws from its own seed instead, on a forked stream that leaves the global one as it was,
    so a run's crops, and with them its result, are the same for any worker count and after a resume.

    Args:
        dataset: the augmented training split (:func:`is_augmented`).
        seed: the run's seed.

    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Draw epoch ``epoch``'s crops (set before the epoch's loader iterator copies the dataset to workers)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        item_seed = int(np.random.SeedSequence([self.seed, self.epoch, index]).generate_state(1)[0])
        # The CPU generator only (the transforms draw on it): CUDA's stream is neither read nor reseeded.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(item_seed)
            return self.dataset[index]


def say(accelerator: Accelerator, message: str, *args: Any) -> None:
    # Every process runs the training; one of them talks.
    if accelerator.is_main_process:
        log.info(message, *args)


def check_process_group(formed: int) -> None:
    """Refuse a launch whose environment says several processes when no process group formed.

    ``accelerate launch --multi_gpu --num_processes 2`` (or torchrun) on a machine without GPUs sets RANK and
    WORLD_SIZE in every process, yet accelerate (without ``ACCELERATE_USE_CPU=1``) picks no backend and leaves
    each process alone: each would train the whole run by itself into the same output_dir.

    Args:
        formed: the number of processes accelerate's state holds.

    Raises:
        ConfigError: WORLD_SIZE > 1 and accelerate's state has one process.

    """
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1 and formed == 1:
        raise ConfigError(
            f"RANK/WORLD_SIZE say {launched} processes but accelerate formed no process group, so each would train "
            "alone into the same output_dir: on CPUs launch with ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
            "--num_processes N -m petl.run ..., or run petl-run as one process"
        )


def single_cpu_launch(formed: int) -> str:
    """The line to say when ``accelerate launch --cpu --num_processes N`` (N > 1) started one process; else "".

    accelerate's ``--cpu`` takes its simple launcher, which starts one process whatever ``--num_processes`` says; it
    sets MASTER_ADDR only when several processes were asked for, and no WORLD_SIZE (torchrun's launchers set it).

    Args:
        formed: the number of processes accelerate's state holds.

    """
    asked = parse_flag_from_env("ACCELERATE_USE_CPU") and "MASTER_ADDR" in os.environ
    if not asked or "WORLD_SIZE" in os.environ or formed != 1:
        return ""
    return (
        "accelerate launch --cpu started one process whatever --num_processes says: training as one process; for "
        "several on CPUs launch with ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N -m petl.run"
    )


def run_device_type() -> str:
    """The device type accelerate will train on in this process (``cuda``, ``cpu``...).

    Asked before the Accelerator exists, the shared state must be the one the Accelerator would make: a bare
    PartialState() ignores ACCELERATE_USE_CPU (AcceleratorState reads it), and a CPU launch of several
    processes then forms no process group.
    """
    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU")).device.type


def resolve_precision(cfg: DictConfig) -> None:
    """Replace ``train.precision=auto`` in ``cfg`` by its meaning on this machine, before the run is fingerprinted.

    The run folder's config.yaml then records what ran, so a CPU run of the default config has the fingerprint of
    one made with ``train.precision=no`` (its committed results stay this config's), and a GPU run's differs.
    """
    if cfg.train.precision == "auto":
        cfg.train.precision = auto_precision(run_device_type())


def run_precision(precision: str, device_type: str) -> tuple[str, str | None]:
    """What ``train.precision`` runs as on ``device_type`` (``no``, ``tf32``, ``bf16``, ``fp16``), and the warning
    where that falls back to fp32 (``None`` where it runs as asked).

    Raises:
        ConfigError: ``tf32`` or ``fp16`` off a CUDA GPU, where either would be the ``no`` run under another config
            fingerprint (accelerate runs fp16 in fp32 there without a word).

    """
    if precision == "auto":  # a config that did not go through petl.train.runner.run (resolve_precision)
        precision = auto_precision(device_type)
    refuse_gpu_only("train.precision", precision, device_type, "this run trains")
    if precision == "bf16" and device_type == "cpu" and not cpu_supports_bf16():
        # accelerate would autocast anyway, through slow emulated bf16 matmuls; result.json records "no".
        return "no", "train.precision=bf16: this CPU has no bf16 instructions (AVX512-BF16/AMX): running in fp32"
    return precision, None


@contextmanager
def cuda_switches(precision: str, deterministic: bool, device_type: str) -> Iterator[None]:
    """Set torch's process-wide CUDA switches as a run sets them on ``device_type``; put them back on leaving.

    The one place petl-run's runner and petl-bench's estimate of a run (:mod:`petl.bench.estimate`) set them, so the
    estimate times the kernels the run will use.  On a CUDA GPU: cuDNN's autotuner (``cudnn.benchmark``) on unless
    ``deterministic``, TF32 as :func:`petl.utils.precision.uses_tf32` says for ``precision``; elsewhere nothing.
    """
    before = torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        if device_type == "cuda":
            # cuDNN's autotuner (timm's train.py turns it on) times several kernels on the first batch and keeps
            # the fastest, which may differ from one run to the next: a deterministic run goes without it.
            torch.backends.cudnn.benchmark = not deterministic
            # TF32 rounds the inputs of a matmul to 10 mantissa bits, the same way every time: deterministic
            # runs keep it; train.precision=no is the one setting in strict fp32.
            tf32 = uses_tf32(precision, "cuda")
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
            if deterministic:
                # cuBLAS repeats its results only with a fixed workspace, read when cuBLAS starts (torch's
                # reproducibility notes); set here, it acts unless this process already ran a CUDA matmul.
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        yield
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def precision_accelerator(precision: str, **kwargs: Any) -> Accelerator:
    """A fresh Accelerator (:func:`petl.train.engine.fresh_accelerator`) in ``precision`` as :func:`run_precision`
    resolves it; ``kwargs`` are accelerate's others.

    Raises:
        ConfigError: accelerate refuses the precision on this device (bf16 on a GPU without it), naming
            ``train.precision``.

    """
    # tf32 is fp32 to accelerate: the TF32 switch is torch's, set by the runner (petl.utils.precision.uses_tf32).
    try:
        return engine.fresh_accelerator(mixed_precision="no" if precision == "tf32" else precision, **kwargs)
    except ValueError as error:  # e.g. bf16 on a GPU without bf16 support
        raise ConfigError(f"train.precision={precision}: {error}") from None


def make_accelerator(cfg: DictConfig, out: Path) -> Accelerator:
    trackers = list(cfg.train.trackers)
    device_type = run_device_type()
    precision, fallback = run_precision(cfg.train.precision, device_type)
    if fallback is not None:
        warn_main(log, fallback)
    # train.compile goes through accelerate's dynamo plugin, which compiles the model in prepare().
    dynamo = "inductor" if cfg.train.compile else None
    missing = engine.compiler_missing(device_type) if cfg.train.compile else None
    if missing:
        warn_main(log, f"train.compile: {missing}; running uncompiled")
        dynamo = None
    accelerator = precision_accelerator(
        precision,
        dynamo_backend=dynamo,
        gradient_accumulation_steps=cfg.train.grad_accum,
        log_with=trackers or None,
        project_dir=str(out),
    )
    check_process_group(accelerator.num_processes)
    if note := single_cpu_launch(accelerator.num_processes):
        log.warning(note)
    return accelerator


def create_backbone(cfg: DictConfig) -> nn.Module:
    """The pretrained (or randomly initialised) timm model, before any method is applied."""
    m = cfg.model
    kwargs = config.model_kwargs(cfg)
    if m.checkpoint:
        if Path(m.checkpoint).is_dir():  # petl-pretrain's --out, say: the weights are one file in it
            raise ConfigError(f"model.checkpoint={m.checkpoint} is a folder: give the weights file in it")
        if not Path(m.checkpoint).is_file():
            raise ConfigError(f"model.checkpoint={m.checkpoint}: no such file")
        if not m.pretrained:
            raise ConfigError("model.checkpoint is set but model.pretrained=false: the file would be ignored")
        # Beside the run's own overlay (its input_size, model_kwargs), which the file does not replace.
        kwargs["pretrained_cfg_overlay"] = {**kwargs.get("pretrained_cfg_overlay", {}), "file": str(m.checkpoint)}
    try:
        # Offline, hub weights fail at once (a cached copy still loads) instead of after half a minute of retries.
        with hub.offline_unless_reachable():
            return timm.create_model(m.name, pretrained=m.pretrained, drop_path_rate=m.drop_path, **kwargs)
    except TypeError as error:
        raise ConfigError(f"model.kwargs: {error}") from None
    except Exception as error:  # timm/hub raise many kinds (RuntimeError, OSError, HTTP errors...)
        if not m.pretrained:
            raise
        if m.checkpoint:
            kwargs = config.model_kwargs(cfg)  # without the file
            try:
                why = run_card.checkpoint_mismatch(m.name, kwargs, m.checkpoint)
            except Exception as reading:  # not a weights file at all
                why = f"cannot read it ({first_line(reading, repr(reading))})"
            raise ConfigError(
                f"model.checkpoint={m.checkpoint} does not fit model={m.name}: {why or first_line(error, 'error')}; "
                "give the weights of this architecture, or the model= they belong to"
            ) from None
        changed = _kwargs_mismatch(cfg, kwargs)
        if changed:
            raise ConfigError(changed) from None
        # Without its closing period: the sentence after it starts with its own.
        first = first_line(error, f"{type(error).__name__} (no weights file)").rstrip(".")
        raise UnreachableError(
            f"cannot load pretrained weights of {m.name}: {first}. Give a local file with model.checkpoint=PATH, "
            "or train from random init with model.pretrained=false"
        ) from None


def _kwargs_mismatch(cfg: DictConfig, kwargs: dict[str, Any]) -> str | None:
    """Why the pretrained weights failed to load into the architecture ``model.kwargs`` changed, or ``None``.

    A kwarg that changes the architecture (``depth``, ``global_pool``...) is bad input, not a failed download: the
    weights were made for the model without it.  ``img_size`` and ``pretrained_cfg_overlay`` (its input size) are
    left out: timm resamples the position grid.
    """
    # The overlay's input_size sizes the images, not the weights' shapes (timm resamples the grid to it).
    changed = {
        key: value for key, value in cfg.model.kwargs.items() if key not in ("img_size", "pretrained_cfg_overlay")
    }
    if not changed:
        return None
    try:
        why = run_card.kwargs_mismatch(cfg.model.name, kwargs, changed)
    except Exception:  # an architecture timm cannot build on the meta device: the load's own error stands
        return None
    if why is None:
        return None
    given = " ".join(f"+model.kwargs.{key}={value}" for key, value in changed.items())
    them = "them" if len(changed) > 1 else "it"
    return (
        f"{given} does not fit the pretrained weights of {cfg.model.name}: {why}; drop {them}, "
        "or train from random init with model.pretrained=false"
    )


def method_config(
    cfg: DictConfig,
    backbone: nn.Module,
    num_classes: int,
    checkpoint: dict[str, Any] | None,
    accelerator: Accelerator,
) -> MethodConfig:
    """The method's config: from the command line, completed by the method's ``calibrate`` hook if it has one.

    A resumed run takes the config its checkpoint recorded, so the weights it restores fit the
    modules they were trained in even if calibrating again would choose differently.
    """
    name = cfg.method.name
    spec = get_method(name)
    recorded = checkpoint.get("method_config") if checkpoint is not None else None
    try:
        if recorded is None:
            method_cfg = make_config(name, num_classes=num_classes, **config.method_options(cfg))
        # Before calibrating: a calibration (NOAH's search, SCT's selection) on a backbone the method does not
        # support would fail on what the backbone lacks, after minutes, as an error of the run (exit 1).
        check_supported(backbone, name)
    except ValueError as error:
        raise config.method_error(name, error) from None
    if recorded is not None:
        try:
            method_cfg = make_config(name, **recorded)
            method_cfg.validate(backbone)
        except ValueError as error:  # a hand-edited option: the command line's are checked, and right
            raise output_dir.damaged_checkpoint(Path(cfg.output_dir), f"method_config: {error}") from None
    if recorded is not None or spec.calibrate is None:
        return method_cfg
    tick = time.perf_counter()
    dataset = calibration_set(cfg, backbone)
    # The training batch size: GPS sums its contrastive gradient over training-size batches (the reference's
    # loader_grad, train_gps.py L133-136) and NOAH's supernet trains on them (its --batch-size); SCT's sums do
    # not depend on it.
    batches = loader(dataset, cfg.train.batch_size, cfg.data.num_workers, cfg.seed)
    try:
        progress = cfg.train.progress and accelerator.is_main_process
        method_cfg = spec.calibrate(backbone.to(accelerator.device), method_cfg, batches, progress=progress)
    except ValueError as error:
        raise RunError(f"method {name}: calibrating on the train split failed: {error}") from None
    say(accelerator, "calibrated %s on %d train images in %.1f s", name, len(dataset), time.perf_counter() - tick)
    return method_cfg


def apply_method(cfg: DictConfig, model: nn.Module, method_cfg: MethodConfig) -> None:
    try:
        apply(model, cfg.method.name, config=method_cfg)
    except ValueError as error:
        raise config.method_error(cfg.method.name, error) from None


def _subset(dataset: Dataset, size: int | None) -> Dataset:
    if size is None or size >= len(dataset):
        return dataset
    keep = np.sort(np.random.default_rng(_SUBSET_SEED).permutation(len(dataset))[:size])
    return Subset(dataset, keep.tolist())


def _image_options(cfg: DictConfig, model: nn.Module) -> dict[str, Any]:
    """How the backbone expects its images, and the task's augmentation setting.

    The size is the built model's own (``model.img_size`` or ``+model.kwargs.img_size`` change it), the rest
    its timm pretrained config's.
    """
    data_cfg = resolve_data_config({}, model=model)
    return dict(
        image_size=config.image_size(model),
        mean=data_cfg["mean"],
        std=data_cfg["std"],
        # The backbone's own resampling filter; FGVC's crop-and-flip protocol unless data.augment says otherwise.
        interpolation=data_cfg["interpolation"],
        augment=cfg.data.augment,
    )


def _build_split(cfg: DictConfig, split: str, image: dict[str, Any]) -> Dataset:
    try:
        return _build_checked(cfg, split, image)
    except petl_data.BadImagesError as error:
        # Image files the user gave that cannot be read: bad input, exit 2 as in petl-predict; the message names
        # the dataset and every path.
        raise ConfigError(str(error)) from None


def _build_checked(cfg: DictConfig, split: str, image: dict[str, Any]) -> Dataset:
    """One split; its unreadable images raise :class:`petl.data.BadImagesError`, every other fault one line."""
    try:
        options = config.data_options(cfg)
        dataset = petl_data.build_dataset(cfg.data.name, split, root=cfg.data.root, options=options, **image)
    except petl_data.BadImagesError:
        raise
    except petl_data.DatasetUnavailableError as error:
        raise UnreachableError(str(error)) from None
    except ValueError as error:
        raise ConfigError(f"data {cfg.data.name}: {error}") from None
    return _subset(dataset, cfg.data.subset)


def datasets(cfg: DictConfig, model: nn.Module) -> dict[str, Dataset]:
    """Train / val (when the split has one) / test, preprocessed as the backbone expects.

    Raises:
        ConfigError: naming every unreadable image of every split at once, so that one fix-up does them all.

    """
    image = _image_options(cfg, model)
    splits = {"train": cfg.data.split}
    if cfg.train.eval_test and petl_data.TEST in config.data_info(cfg).splits:
        splits["test"] = petl_data.TEST
    if cfg.data.split == petl_data.TRAIN:
        splits["val"] = petl_data.VAL
    built: dict[str, Dataset] = {}
    bad: dict[Path, str] = {}
    dataset = cfg.data.name
    for role, split in splits.items():
        try:
            built[role] = _build_checked(cfg, split, image)
        except petl_data.BadImagesError as error:  # the other splits are still checked
            dataset = error.dataset
            bad.update(error.bad)
    if bad:
        raise ConfigError(str(petl_data.BadImagesError(dataset, sorted(bad.items()))))
    if petl_data.get_info(cfg.data.name).root == "required" and is_main_process():  # the user's own files
        _warn_copies(built)
    return built


def _warn_copies(built: dict[str, Dataset]) -> None:
    """Say which val and test images are copies of training images (their accuracy counts images the run trained
    on) and which training images are in two classes.

    A photo copied into test/ (or twice into train/, one copy then held out as val) is byte for byte a training
    image; nothing else tells the user why the test number is high.  Said once per process and split.
    """
    clash = conflicts(built["train"])
    if clash:
        path, other = clash[0]
        message = (
            f"{len(clash)} training {'image is' if len(clash) == 1 else 'images are'} also in another class (first: "
            f"{path} = {other}): the run learns two labels for one image; keep each image in its one class folder"
        )
        warn_once(log, message)
    for role in ("val", "test"):
        found = copies(built[role], built["train"]) if role in built else []
        if not found:
            continue
        path, original = found[0]
        copy = (
            "is a byte-for-byte copy of a training image"
            if len(found) == 1
            else "are byte-for-byte copies of training images"
        )
        message = (
            f"{len(found)} of the {len(built[role])} {role} images {copy} (first: {path} = {original}): "
            f"the {role} accuracy counts images the run trained on; remove the copies (each image once, in one split)"
        )
        warn_once(log, message)


def eval_spec(cfg: DictConfig, model: nn.Module, info: petl_data.DatasetInfo) -> petl_data.ImageSpec:
    """The preprocessing the run evaluated with: the backbone's size, mean/std, interpolation; the task's crop."""
    image = _image_options(cfg, model)
    crop = info.crops(image["augment"])
    return petl_data.ImageSpec(
        image_size=image["image_size"], mean=tuple(image["mean"]), std=tuple(image["std"]),
        interpolation=image["interpolation"], crop=crop,
    )  # fmt: skip


def calibration_set(cfg: DictConfig, model: nn.Module) -> Dataset:
    """The training split (the same examples) with the evaluation transform: no random crop or flip."""
    return _build_split(cfg, cfg.data.split, {**_image_options(cfg, model), "eval_transform": True})


def is_augmented(dataset: Dataset) -> bool:
    """Whether ``dataset`` draws a new random crop and flip at every access (FGVC's training transform)."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    spec = getattr(dataset, "spec", None)
    return bool(getattr(spec, "augment", False))


def loader(
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
