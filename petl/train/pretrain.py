"""Formula-driven pretraining of petl's backbones on FractalDB-style images (``petl-pretrain``'s API).

Any timm architecture that takes the fractals' 32 px images trains here (the default ViT, the Swin): the
model is built by name and nothing below depends on its kind.  The command line, its options and exit statuses
are :mod:`petl.cli.pretrain`'s.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from pathlib import Path

import timm
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from petl.backbones import models
from petl.data.fractaldb import FractalConfig, generate, search_systems, to_model_input
from petl.store import files
from petl.train.engine import TrainSettings, build_optimizer, fit
from petl.utils.provenance import git_commit, versions
from petl.utils.random import rng_state, set_rng_state

ARCH = "vit_fractal_tiny_patch4_32"


def output_files(out_dir: Path, arch: str = ARCH) -> tuple[Path, Path]:
    """The weights and provenance files :func:`pretrain` writes into ``out_dir``."""
    return out_dir / f"{arch}.fractaldb.safetensors", out_dir / f"{arch}.fractaldb.json"


def partial_file(out_dir: Path, arch: str = ARCH) -> Path:
    """The checkpoint an unfinished pretraining leaves after each epoch (removed when it ends)."""
    return out_dir / f"{arch}.fractaldb.partial.pt"


def _normalised(dataset: TensorDataset) -> TensorDataset:
    images, labels = dataset.tensors
    return TensorDataset(to_model_input(images, models.FRACTAL_MEAN, models.FRACTAL_STD), labels)


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

    Returns:
        The provenance record.

    Raises:
        ValueError: fewer training images than ``batch_size`` (no step would train), or a checkpoint in ``out_dir``
            is of another recipe (or damaged).
    """
    if fractal.num_classes * fractal.instances < batch_size:  # incomplete batches are dropped: no step would run
        raise ValueError(
            f"batch_size {batch_size} is more than the {fractal.num_classes * fractal.instances} training images: "
            "no step would train"
        )
    start = time.time()
    set_seed(seed)
    accelerator = Accelerator(mixed_precision=precision)
    systems = search_systems(fractal)
    train_set = _normalised(generate(fractal, systems))
    val_set = _normalised(
        generate(dataclasses.replace(fractal, instances=val_instances), systems, seed=fractal.seed + 10_000)
    )
    generation_seconds = time.time() - start

    model = timm.create_model(arch, num_classes=fractal.num_classes, drop_path_rate=drop_path)
    generator = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator)
    val_loader = DataLoader(val_set, batch_size=256)
    optimizer, scheduler = build_optimizer(model, settings, len(train_loader))
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler
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
    dtype = {"float32": torch.float32, "float16": torch.float16}[weights_dtype]
    partial = partial_file(out_dir, arch) if out_dir is not None else None
    done: list[dict] = []
    seconds_before = 0.0
    checkpoint = files.load_checkpoint(partial) if partial is not None else None
    if checkpoint is not None:
        if json.loads(checkpoint["recipe"]) != recipe:
            raise ValueError(f"{partial} is a pretraining of another recipe: remove it, or choose another --out")
        accelerator.unwrap_model(model).load_state_dict(checkpoint["trainable"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        set_rng_state(checkpoint["rng"])
        generator.set_state(checkpoint["loader_rng"])
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

    fit(model, train_loader, {"val": val_loader}, settings, accelerator, optimizer, scheduler, len(done), on_epoch_end)
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
        if partial is not None:
            partial.unlink(missing_ok=True)
    return record
