"""Formula-driven pretraining of petl's default backbone on FractalDB-style images (``petl-pretrain``'s API).

The command line, its options and exit statuses are :mod:`petl.cli.pretrain`'s.
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

ARCH = "vit_fractal_tiny_patch4_32"


def output_files(out_dir: Path) -> tuple[Path, Path]:
    """The weights and provenance files :func:`pretrain` writes into ``out_dir``."""
    return out_dir / f"{ARCH}.fractaldb.safetensors", out_dir / f"{ARCH}.fractaldb.json"


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
) -> dict:
    """Pretrain the default ViT on generated fractals and (optionally) write weights + provenance.

    Args:
        fractal: the FractalDB settings (classes, instances, seed...).
        settings: optimisation settings for the shared engine.
        batch_size: images per step.
        val_instances: fresh instances per class (another seed) to measure pretraining accuracy.
        drop_path: stochastic depth rate during pretraining.
        precision: accelerate mixed precision (``no``, ``bf16``, ``fp16``).
        out_dir: where to write ``<arch>.fractaldb.safetensors`` and ``.json``; None writes nothing.
        seed: seed of the model init and data order.

    Returns:
        The provenance record.
    """
    start = time.time()
    set_seed(seed)
    accelerator = Accelerator(mixed_precision=precision)
    systems = search_systems(fractal)
    train_set = _normalised(generate(fractal, systems))
    val_set = _normalised(
        generate(dataclasses.replace(fractal, instances=val_instances), systems, seed=fractal.seed + 10_000)
    )
    generation_seconds = time.time() - start

    model = timm.create_model(ARCH, num_classes=fractal.num_classes, drop_path_rate=drop_path)
    generator = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator)
    val_loader = DataLoader(val_set, batch_size=256)
    optimizer, scheduler = build_optimizer(model, settings, len(train_loader))
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, val_loader, scheduler
    )

    def log(epoch: int, metrics: dict) -> None:
        accelerator.print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))

    history = fit(model, train_loader, {"val": val_loader}, settings, accelerator, optimizer, scheduler, 0, log)
    model = accelerator.unwrap_model(model)
    record = {
        "arch": ARCH,
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
        "wall_seconds": round(time.time() - start, 1),
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        # The same version and commit lookup as every petl-run record (git_commit, git_dirty).
        "versions": files.versions(),
        **files.git_commit(),
    }
    if out_dir is not None:
        weights, provenance = output_files(out_dir)
        # The pretraining head is task-specific: downstream runs reset it, so it is not shipped.
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if not k.startswith("head.")}
        files.write_atomic(weights, lambda tmp: save_file(state, str(tmp), metadata={"arch": ARCH}))
        files.write_text(provenance, json.dumps(record, indent=2) + "\n")
    return record
