"""Formula-driven pretraining of petl's backbones on FractalDB-style images (``petl-pretrain``'s API).

Any timm architecture that takes the fractals' 32 px images trains here (the default ViT, the Swin): the
model is built by name and nothing below depends on its kind.  The command line, its options and exit statuses
are :mod:`petl.cli.pretrain`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import timm
import torch
from accelerate.utils import set_seed
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from petl.backbones import models
from petl.data.fractaldb import FractalConfig, generate, search_systems, to_model_input
from petl.store import files, lock
from petl.train.engine import TrainSettings, build_optimizer, fit, fresh_accelerator
from petl.utils import paths
from petl.utils.errors import RunError, UsageError
from petl.utils.provenance import git_commit, versions
from petl.utils.random import rng_state, set_rng_state
from petl.utils.text import first_line

ARCH = "vit_fractal_tiny_patch4_32"

# What to do with an unfinished pretraining's checkpoint that cannot be continued.
START_OVER = "remove it to start over, or choose another --out"

# The petl-pretrain option that sets each recipe entry, to name a difference the way the user typed it.
RECIPE_FLAGS = {
    "arch": "--model",
    "fractal_config.num_classes": "--classes",
    "fractal_config.instances": "--instances",
    "fractal_config.seed": "--seed",
    "train_settings.epochs": "--epochs",
    "train_settings.lr": "--lr",
    "train_settings.weight_decay": "--weight-decay",
    "train_settings.warmup_frac": "--warmup-frac",
    "train_settings.label_smoothing": "--label-smoothing",
    "batch_size": "--batch-size",
    "precision": "--precision",
    "seed": "--seed",
}


def output_files(out_dir: Path, arch: str = ARCH) -> tuple[Path, Path]:
    """The weights and provenance files :func:`pretrain` writes into ``out_dir``."""
    return out_dir / f"{arch}.fractaldb.safetensors", out_dir / f"{arch}.fractaldb.json"


def partial_file(out_dir: Path, arch: str = ARCH) -> Path:
    """The checkpoint an unfinished pretraining leaves after each epoch (removed when it ends)."""
    return out_dir / f"{arch}.fractaldb.partial.pt"


def lock_file(out_dir: Path, arch: str = ARCH) -> Path:
    """The lock a pretraining of ``arch`` holds in ``out_dir`` while it runs.

    One per architecture: the folder holds the files of several, and pretrainings of different ones may run side by
    side into it.
    """
    return out_dir / f".{arch}.fractaldb.lock"


class InUseError(RunError):
    """Another live process is pretraining the same architecture into the same folder now."""


@contextmanager
def claim(out_dir: Path, arch: str = ARCH) -> Iterator[None]:
    """Hold ``out_dir`` for a pretraining of ``arch``: checked writable, then locked until the block ends.

    The lock is :mod:`petl.store.lock`'s (the holder's pid; one left by a dead process taken over), under a name
    of its own per architecture.  It is released however the block ends (a failure, Ctrl-C, SIGTERM); a folder
    this claim created is removed again if nothing was written into it.

    Raises:
        UsageError: ``out_dir`` cannot be written (a file in the way, read-only, full).
        InUseError: a live process holds the lock: it is pretraining ``arch`` into ``out_dir`` now.
    """
    unwritable = paths.cannot_write_in(out_dir, "choose another --out", fill=True)
    if unwritable is not None:
        raise UsageError(f"--out {unwritable}")
    created = [p for p in (out_dir, *out_dir.parents) if not p.exists()]
    held = lock_file(out_dir, arch)
    try:
        taken = lock.acquire_lock(out_dir, held.name)
    except OSError as error:  # changed since the check (another process removed or filled it)
        raise UsageError(f"--out {paths.cannot_be_written(out_dir, error, 'choose another --out')}") from None
    if not taken:
        # Said as petl-run says an output_dir in use (exit 1): the other one's files would be overwritten.
        raise InUseError(
            f"--out {out_dir} is in use by another pretraining of {arch} ({lock.describe_holder(out_dir, held.name)}): "
            f"wait for it to finish or choose another --out (delete {held} if that process is gone)"
        )
    try:
        yield
    finally:
        lock.release_lock(out_dir, held.name)
        for folder in created:  # deepest first; stops at the first one holding something
            try:
                folder.rmdir()
            except OSError:
                break


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def recipe_difference(then: dict, now: dict) -> str:
    """What differs between two recipes, as options: ``--lr 0.001 then, 0.002 now`` (the first few)."""
    old, new = _flat(then), _flat(now)
    said: dict[str, str] = {}
    for key in sorted(old.keys() | new.keys()):
        if old.get(key, "(unset)") != new.get(key, "(unset)"):
            name = RECIPE_FLAGS.get(key, key)
            said.setdefault(name, f"{name} {old.get(key, '(unset)')} then, {new.get(key, '(unset)')} now")
    return "; ".join(list(said.values())[:3])


def _resumable(partial: Path, recipe: dict) -> dict | None:
    """The checkpoint in ``partial`` if there is one, checked: a petl-pretrain checkpoint of this ``recipe``.

    Raises:
        UsageError: the file is not a pretraining checkpoint petl wrote (cut short, another kind), or it is one of
            another recipe (the difference named).
    """
    try:
        checkpoint = files.load_checkpoint(partial)
    except files.NewerFileError as error:  # not damaged: this petl is too old to read it, as petl-run's resume says
        raise UsageError(
            f"{error}: upgrade petl to continue it, remove it to start over, or choose another --out"
        ) from None
    except files.DamagedFileError as error:
        raise UsageError(f"{error}: {START_OVER}") from None
    if checkpoint is None:
        return None
    try:
        recorded = json.loads(checkpoint["recipe"])
    except (KeyError, TypeError, ValueError):  # no recipe (petl-run's checkpoint.pt), one that is not JSON
        recorded = None
    if isinstance(recorded, dict) and recorded != recipe:
        raise UsageError(
            f"{partial} is an unfinished pretraining with other options ({recipe_difference(recorded, recipe)}): "
            f"give those to continue it, {START_OVER}"
        )
    history, seconds = checkpoint.get("history"), checkpoint.get("seconds")
    well_formed = (
        isinstance(recorded, dict)
        and isinstance(checkpoint.get("loader_rng"), torch.Tensor)
        and isinstance(history, list)
        and all(isinstance(h, dict) and isinstance(h.get("images"), (int, float)) for h in history)
        and checkpoint.get("epoch") == len(history)
        and isinstance(seconds, (int, float))
    )
    if not well_formed:
        raise UsageError(f"{partial} is damaged (not a petl-pretrain checkpoint): {START_OVER}")
    return checkpoint


def check_arch(arch: str, num_classes: int) -> None:
    """Raise a UsageError unless ``arch`` builds and takes the fractals' 32 px images (a forward of one)."""
    try:
        model = timm.create_model(arch, num_classes=num_classes).eval()
        with torch.no_grad():
            model(torch.zeros(1, 3, 32, 32))
    except Exception as error:  # timm asserts the input size, or fails on its shape deeper in
        raise UsageError(
            f"{arch} does not take the fractals' 32 px images ({first_line(error, type(error).__name__)}): "
            "choose an architecture made for 32 px (petl's own: petl.backbones.models)"
        ) from None


def _normalised(dataset: TensorDataset) -> TensorDataset:
    images, labels = dataset.tensors
    return TensorDataset(to_model_input(images, models.FRACTAL_MEAN, models.FRACTAL_STD), labels)


def _fractal_data(fractal: FractalConfig, val_instances: int) -> tuple[TensorDataset, TensorDataset]:
    """The generated training images and ``val_instances`` fresh ones per class (another seed), normalised."""
    systems = search_systems(fractal)
    train_set = _normalised(generate(fractal, systems))
    val = dataclasses.replace(fractal, instances=val_instances)
    return train_set, _normalised(generate(val, systems, seed=fractal.seed + 10_000))


def _write_outputs(out_dir: Path, arch: str, model: torch.nn.Module, dtype: torch.dtype, record: dict) -> None:
    """The weights (without the head) in ``dtype`` and the provenance ``record`` (given their SHA-256) in
    ``out_dir``; the checkpoint, now finished with, removed.
    """
    weights, provenance = output_files(out_dir, arch)
    # The pretraining head is task-specific: downstream runs reset it, so it is not shipped.
    state = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in model.state_dict().items()
        if not k.startswith("head.")
    }
    files.write_atomic(weights, lambda tmp: save_file(state, str(tmp), metadata={"arch": arch}))
    record["weights_sha256"] = files.file_sha256(weights)
    files.write_text(provenance, json.dumps(record, indent=2) + "\n")
    partial_file(out_dir, arch).unlink(missing_ok=True)


def pretrain(
    fractal: FractalConfig,
    settings: TrainSettings,
    batch_size: int = 128,
    val_instances: int = 5,
    drop_path: float = 0.1,
    precision: str = "no",
    out_dir: Path | None = None,
    seed: int = 0,
    arch: str = ARCH,
    command: str | None = None,
    weights_dtype: str = "float32",
    overwrite: bool = True,
) -> dict:
    """Pretrain ``arch`` on generated fractals and (optionally) write weights + provenance.

    With ``out_dir``, a checkpoint is saved there after each epoch; a later call with the same recipe continues
    from it (same schedule, weights, optimizer and random generators) and removes it once the weights are written.

    Args:
        fractal: the FractalDB settings (classes, instances, seed...).
        settings: optimisation settings for the shared engine.
        batch_size: images per step.
        val_instances: fresh instances per class (another seed) to measure pretraining accuracy.
        drop_path: stochastic depth rate during pretraining.
        precision: accelerate mixed precision (``no``, ``bf16``, ``fp16``).
        out_dir: where to write ``<arch>.fractaldb.safetensors`` and ``.json``; None writes nothing.
        seed: seed of the model init and data order.
        arch: the timm architecture to pretrain (it must take 32 px images).
        command: the command line to record in the provenance.
        weights_dtype: the floating-point type of the written weights (``float32`` or ``float16``, half the
            size; the model casts them back to its own type as it loads them).
        overwrite: replace weights already in ``out_dir``; False refuses them (a UsageError), checked under the lock.

    Returns:
        The provenance record.

    Raises:
        ValueError: fewer than 2 classes, or fewer training images than ``batch_size`` (no step would train).
        UsageError: ``out_dir`` cannot be written, ``arch`` does not take 32 px images, or the checkpoint in
            ``out_dir`` is damaged or of another recipe (the difference named); each before any image is generated.
        InUseError: another live process is pretraining ``arch`` into ``out_dir`` (it holds the lock of
            :func:`claim`, released when this call ends however it ends).
        UsageError: a launch of several processes (``WORLD_SIZE`` > 1): pretraining runs as one process; ``fp16``
            without a CUDA GPU (accelerate would run it in fp32).
    """
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        # Every process would claim the lock (all but one then refused) and write the checkpoint and weights, and
        # the schedule would count the unsharded loader's steps: it is not made for several processes.
        raise UsageError(
            f"WORLD_SIZE={launched}: petl-pretrain runs as one process; start it without accelerate launch or torchrun"
        )
    if fractal.num_classes < 2:  # one logit: the loss is 0 and nothing trains
        raise ValueError(f"num_classes {fractal.num_classes}: pretraining needs 2 or more classes")
    if fractal.num_classes * fractal.instances < batch_size:  # incomplete batches are dropped: no step would run
        raise ValueError(
            f"batch_size {batch_size} is more than the {fractal.num_classes * fractal.instances} training images: "
            "no step would train"
        )
    recipe = {
        "arch": arch,
        "fractal_config": dataclasses.asdict(fractal),
        "train_settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "progress"},
        "batch_size": batch_size,
        "drop_path": drop_path,
        "precision": precision,
        "seed": seed,
    }
    # Checked before the images are generated and the model built (minutes at the documented sizes): a folder
    # that cannot be written failed only at the first epoch's checkpoint, a checkpoint of other options or a
    # model that does not take 32 px images only after the generation.
    partial = partial_file(out_dir, arch) if out_dir is not None else None
    # Locked before the checkpoint is read: another pretraining of this architecture into this folder writes the
    # same checkpoint and weights, and the two would silently mix.
    with claim(out_dir, arch) if out_dir is not None else nullcontext():
        existing = [p for p in output_files(out_dir, arch) if p.exists()] if out_dir is not None else []
        if existing and not overwrite:
            raise UsageError(
                f"{existing[0]} exists (an earlier pretraining): pass --overwrite to replace it, "
                "or choose another --out"
            )
        checkpoint = _resumable(partial, recipe) if partial is not None else None
        check_arch(arch, fractal.num_classes)
        start = time.time()
        set_seed(seed)
        accelerator = fresh_accelerator(mixed_precision=precision)
        if precision == "fp16" and accelerator.device.type != "cuda":
            # accelerate accepts it and runs in fp32: the record would say fp16 of a pretraining that never used it.
            raise UsageError(
                f"--precision fp16 needs a CUDA GPU ({accelerator.device.type} here runs it in fp32): "
                "give --precision bf16 or no"
            )
        train_set, val_set = _fractal_data(fractal, val_instances)
        generation_seconds = time.time() - start

        model = timm.create_model(arch, num_classes=fractal.num_classes, drop_path_rate=drop_path)
        generator = torch.Generator().manual_seed(seed)
        train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator)
        val_loader = DataLoader(val_set, batch_size=256)
        optimizer, scheduler = build_optimizer(model, settings, len(train_loader))
        model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
            model, optimizer, train_loader, val_loader, scheduler
        )
        dtype = {"float32": torch.float32, "float16": torch.float16}[weights_dtype]
        done: list[dict] = []
        seconds_before = 0.0
        if checkpoint is not None:
            try:
                accelerator.unwrap_model(model).load_state_dict(checkpoint["trainable"])
                optimizer.load_state_dict(checkpoint["optimizer"])
                scheduler.load_state_dict(checkpoint["scheduler"])
                set_rng_state(checkpoint["rng"])
                generator.set_state(checkpoint["loader_rng"])
            except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as error:  # tensors of other shapes
                why = first_line(error, type(error).__name__)
                raise UsageError(f"{partial} is damaged ({why}): {START_OVER}") from None
            done, seconds_before = checkpoint["history"], checkpoint["seconds"]
            accelerator.print(f"resuming {partial} after epoch {checkpoint['epoch']}/{settings.epochs}")

        def on_epoch_end(epoch: int, metrics: dict) -> None:
            accelerator.print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))
            done.append(metrics)
            if partial is not None:
                state = {
                    "epoch": epoch + 1,
                    "trainable": accelerator.unwrap_model(model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": rng_state(),
                    "loader_rng": generator.get_state(),
                    "history": done,
                    "seconds": seconds_before + time.time() - start,
                    "recipe": json.dumps(recipe),
                }
                files.save_checkpoint(partial, state)

        evals = {"val": val_loader}
        fit(model, train_loader, evals, settings, accelerator, optimizer, scheduler, len(done), on_epoch_end)
        history = done
        model = accelerator.unwrap_model(model)
        record = {
            "arch": arch,
            "fractal_config": dataclasses.asdict(fractal),
            "train_settings": dataclasses.asdict(settings),
            "batch_size": batch_size,
            "drop_path": drop_path,
            "precision": precision,
            "seed": seed,
            "images_seen": int(sum(h["images"] for h in history)),
            "final_train_top1": history[-1]["train_top1"],
            "final_val_top1": history[-1]["val_top1"],
            "val_note": f"{val_instances} fresh instances per class drawn with seed {fractal.seed + 10_000}",
            "history": history,
            "generation_seconds": round(generation_seconds, 1),
            # Every session's time when a pretraining was resumed (each session generates the images again).
            "wall_seconds": round(seconds_before + time.time() - start, 1),
            "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
            # The same version and commit lookup as every petl-run record (git_commit, git_dirty).
            "versions": versions(),
            **git_commit(),
            **({"command": command} if command else {}),
            "weights_dtype": weights_dtype,
        }
        if out_dir is not None:
            _write_outputs(out_dir, arch, model, dtype, record)
        return record
